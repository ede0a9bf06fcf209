"""What the chat-output parser emits: small events, in the order the text produced them.

A response is the concatenation of its events: ``ReasoningDelta`` texts join to the reasoning,
``ContentDelta`` texts to the answer, and each tool call is a ``ToolCallStart``, then
``ToolCallArgsDelta`` texts that join to its JSON arguments string, then a ``ToolCallEnd``.
Nothing emitted is ever taken back.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order the calls appear
    id: str  # the model's own call id where its format has one, else a fresh "call_..."
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str  # a piece of the JSON arguments string


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))
