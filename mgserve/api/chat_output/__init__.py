"""Reading a chat model's output: reasoning, content and tool calls, as it streams.

``ChatOutputParser`` (parser.py) turns generated text into events (events.py); the format comes
from the chat template (formats.py); the tool-call syntaxes are read by xml_calls.py and
json_calls.py.
"""

from mgserve.api.chat_output.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from mgserve.api.chat_output.formats import ChatFormat, detect_format
from mgserve.api.chat_output.parser import ChatOutputParser

__all__ = [
    "ChatFormat",
    "ChatOutputParser",
    "ContentDelta",
    "Event",
    "ReasoningDelta",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "detect_format",
    "new_call_id",
]
