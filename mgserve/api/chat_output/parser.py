"""The incremental chat-output parser: generated text in, reasoning, content and call events out.

The output is read as ``[<think> reasoning </think>] content [tool call | content]...``:

- a reasoning block opens the output (after whitespace), or is already open when the prompt ended
  inside it (``think_open``: Qwen 3.5 with thinking on); with ``reasoning=False`` (the
  ``none`` reasoning format) it is passed through as content, markers and all;
- tool calls are read only outside reasoning, only when ``tools_enabled``, in the format's syntax
  (formats.py); a call that turns out malformed is content text, marker included;
- whitespace around the reasoning and before a call is dropped, as the templates add it.

Text that may be the start of a marker is held back until the next text decides it, so nothing
emitted is ever taken back; ``finish`` flushes what is held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mgserve.api.chat_output.calls import CallParser
from mgserve.api.chat_output.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from mgserve.api.chat_output.formats import ChatFormat, tool_schemas
from mgserve.api.chat_output.json_calls import HermesCall, Llama3Call, MistralCalls
from mgserve.api.chat_output.markers import split_at_marker, trailing_space
from mgserve.api.chat_output.xml_calls import XmlCall

# the marker that opens a call, per format (Llama 3 may also open its answer with the JSON)
_CALL_MARKERS = {
    "xml": "<tool_call>",
    "hermes": "<tool_call>",
    "mistral": "[TOOL_CALLS]",
    "llama3": "<|python_tag|>",
}


class ChatOutputParser:
    def __init__(
        self,
        format: ChatFormat,
        reasoning: bool = True,  # split the reasoning block out (False: it stays content)
        tools_enabled: bool = False,
        *,
        tools: list[Any] | None = None,  # the request's tools: their names and parameter types
        think_open: bool = False,  # the prompt ended inside the reasoning block
        parallel: bool = True,  # False: calls after the first are dropped
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.format = format
        self.split = reasoning
        self.tools_on = tools_enabled and format.tools in _CALL_MARKERS
        self.schemas = tool_schemas(tools)
        self.names = set(self.schemas) if tools else None
        self.parallel = parallel
        self.new_id = new_id
        self.buf = ""  # text read, not yet decided
        self.call: CallParser | None = None
        self.call_marker = ""  # the call's marker and the whitespace before it: content if bad
        self.n_calls = 0  # calls read whole (or committed) so far
        self.has_calls = False  # a ToolCallStart was emitted
        self.at_answer = True  # at the start of the answer (Llama 3: a call may open it)
        self.lstrip = self.split and think_open  # drop the whitespace that comes next
        think = format.think
        self.state = "content" if think is None else "think" if think_open else "start"
        self.steps: dict[str, Callable[[], list[Event] | None]] = {
            "start": self._start,
            "think": self._think,
            "content": self._content,
            "call": self._call,
        }

    # -- the public side -------------------------------------------------------------------------

    @property
    def in_reasoning(self) -> bool:
        """Whether the text read so far ends inside the reasoning block."""
        return self.state == "think"

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.call is not None:
            out += self.call.feed(text)
        else:
            self.buf += text
        return self._kept(out + self._run())

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self.call is not None:
            out += self.call.finish()
            out += self._run()
        tail, self.buf = self.buf, ""
        if self.lstrip:
            tail = tail.lstrip()
        if self.state == "think" and self.split:
            out.append(ReasoningDelta(tail.rstrip()))
        else:
            out.append(ContentDelta(tail))
        return self._kept(
            [e for e in out if not isinstance(e, ContentDelta | ReasoningDelta) or e.text]
        )

    # -- states ----------------------------------------------------------------------------------

    def _run(self) -> list[Event]:
        out: list[Event] = []
        while (step := self.steps[self.state]()) is not None:
            out += step
        return out

    def _kept(self, events: list[Event]) -> list[Event]:
        if not self.parallel:
            events = [e for e in events if not _call_index(e)]
        self.has_calls = self.has_calls or any(isinstance(e, ToolCallStart) for e in events)
        return events

    def _start(self) -> list[Event] | None:
        """Before the first text: does a reasoning block open the output?"""
        assert self.format.think is not None
        opening = self.format.think[0]
        s = self.buf.lstrip()
        if len(s) < len(opening) and opening.startswith(s):
            return None
        self.state = "content"
        if not s.startswith(opening):
            return []
        if not self.split:
            cut = len(self.buf) - len(s) + len(opening)
            out, self.buf = self.buf[:cut], self.buf[cut:]
            self.state = "think"
            return [ContentDelta(out)]
        self.buf, self.state, self.lstrip = s[len(opening) :], "think", True
        return []

    def _strip(self) -> bool:
        """Drops leading whitespace where it is due; False while only whitespace has come."""
        if self.lstrip:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.lstrip = False
        return True

    def _think(self) -> list[Event] | None:
        assert self.format.think is not None
        closing = self.format.think[1]
        if not self._strip():
            return None
        safe, marker, rest = split_at_marker(self.buf, [closing])
        if marker is None:
            hold = trailing_space(safe) if self.split else 0
            self.buf = safe[len(safe) - hold :] + rest
            text = safe[: len(safe) - hold]
            return [self._reasoning(text)] if text else None
        self.buf, self.state, self.lstrip = rest, "content", self.split
        if not self.split:
            return [ContentDelta(safe + marker)]
        return [ReasoningDelta(safe.rstrip())] if safe.rstrip() else []

    def _reasoning(self, text: str) -> Event:
        return ReasoningDelta(text) if self.split else ContentDelta(text)

    def _content(self) -> list[Event] | None:
        if not self._strip():
            return None
        if not self.tools_on:
            text, self.buf = self.buf, ""
            return [ContentDelta(text)] if text else None
        if self.format.tools == "llama3" and self.at_answer:
            s = self.buf.lstrip()
            if not s:
                return None
            self.at_answer = False
            if s.startswith("{"):
                return self._begin_call("", self.buf)  # its leading space goes with it
        safe, marker, rest = split_at_marker(self.buf, [_CALL_MARKERS[self.format.tools]])
        if marker is not None:
            text = safe.rstrip()
            out = [ContentDelta(text)] if text else []
            return out + self._begin_call(safe[len(text) :] + marker, rest)
        hold = trailing_space(safe)  # dropped if a call follows
        self.buf = safe[len(safe) - hold :] + rest
        text = safe[: len(safe) - hold]
        return [ContentDelta(text)] if text else None

    def _begin_call(self, marker: str, text: str) -> list[Event]:
        """A call parser gets ``text``; ``marker`` (and the space before it) is what the call's
        text starts with when it is content after all."""
        kind = self.format.tools
        args = (self.n_calls, self.names, self.new_id)
        if kind == "xml":
            self.call = XmlCall(*args, self.schemas)
        else:
            self.call = {"hermes": HermesCall, "llama3": Llama3Call, "mistral": MistralCalls}[kind](
                *args
            )
        self.call_marker, self.buf, self.state = marker, "", "call"
        return self.call.feed(text)

    def _call(self) -> list[Event] | None:
        call = self.call
        assert call is not None
        if call.status == "open":
            return None
        self.call, self.state = None, "content"
        if call.status == "done":
            self.n_calls += call.n_calls
            self.buf, self.lstrip, self.at_answer = call.rest, True, True
            return []
        # not a call: its marker and text are content, read again for a later call
        self.buf, self.lstrip, self.at_answer = call.raw, False, False
        return [ContentDelta(self.call_marker)] if self.call_marker else []


def _call_index(e: Event) -> int:
    """The call an event belongs to (0 for content and reasoning)."""
    return e.index if isinstance(e, ToolCallStart | ToolCallArgsDelta | ToolCallEnd) else 0
