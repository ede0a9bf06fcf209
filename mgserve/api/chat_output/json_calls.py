"""Tool calls written as JSON: Hermes / Qwen 2.5-3 ``<tool_call>``, Llama 3.x, Mistral.

Each call is emitted whole once its JSON has closed and checked out (a known tool name, arguments
that are an object), so a malformed one can still become text:

- ``HermesCall``: after ``<tool_call>``, ``{"name": ..., "arguments": ...}`` then ``</tool_call>``
  (a missing closing tag at the end of the output is forgiven);
- ``Llama3Call``: ``{"name": ..., "parameters": ...}`` at the start of the answer or after
  ``<|python_tag|>``;
- ``MistralCalls``: after ``[TOOL_CALLS]``, a JSON list of calls (Nemo, each with its own ``id``),
  or ``NAME[ARGS]{...}`` / ``NAME[CALL_ID]ID[ARGS]{...}`` (Small 3.2, Devstral, Ministral).
"""

from __future__ import annotations

import re

from mgserve.api.chat_output.calls import CallParser, JsonSpan, call_from, load_json
from mgserve.api.chat_output.events import Event

CLOSE = "</tool_call>"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_MAX_NAME = 256  # a name longer than this is no call


class _JsonValueCall(CallParser):
    """A JSON value that must start (after whitespace) with ``{`` or ``[``, at ``self.at`` or
    later in ``raw``."""

    opening = "{"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.span = JsonSpan()
        self.at = 0  # where the value may start (after a head the format writes first)
        self.start = -1  # where the value starts in raw
        self.end: int | None = None  # just past it

    def _value_end(self) -> int | None:
        """Advance over raw; None while the value is open (status "bad" if it cannot start)."""
        if self.start < 0:
            stripped = self.raw[self.at :].lstrip()
            if not stripped:
                return None
            if stripped[0] not in self.opening:
                self.status = "bad"
                return None
            self.start = len(self.raw) - len(stripped)
        if self.end is None:
            end = self.span.scan(self.raw[self.start :])
            self.end = None if end is None else self.start + end
        return self.end

    def _emit(self, calls: list[object]) -> list[Event]:
        checked = [call_from(c) for c in calls]
        if not checked or any(c is None or not self.known(c.name) for c in checked):
            self.status = "bad"
            return []
        out: list[Event] = []
        for c in checked:
            assert c is not None
            out += self.whole_call(c.name, c.arguments, c.id)
        return out


class HermesCall(_JsonValueCall):
    def feed(self, text: str) -> list[Event]:
        self.raw += text
        end = self._value_end()
        if end is None:
            return []
        after = self.raw[end:]
        tail = after.lstrip()
        if len(tail) < len(CLOSE) and CLOSE.startswith(tail):
            return []  # the closing tag may still come
        if not tail.startswith(CLOSE):
            self.status = "bad"
            return []
        events = self._emit([load_json(self.raw[self.start : end])])
        if self.status != "bad":
            self.status = "done"
            self.rest = tail[len(CLOSE) :]
        return events

    def finish(self) -> list[Event]:
        if self.status == "open" and self.end is not None and not self.raw[self.end :].strip():
            events = self._emit([load_json(self.raw[self.start : self.end])])
            self.status = "bad" if self.status == "bad" else "done"
            return events
        self.status = "bad"
        return []


class Llama3Call(_JsonValueCall):
    def feed(self, text: str) -> list[Event]:
        self.raw += text
        end = self._value_end()
        if end is None:
            return []
        events = self._emit([load_json(self.raw[self.start : end])])
        if self.status != "bad":
            self.status = "done"
            self.rest = self.raw[end:]
        return events

    def finish(self) -> list[Event]:
        self.status = "bad"  # finish is only reached with the object still open
        return []


class MistralCalls(_JsonValueCall):
    opening = "{["

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.call_id: str | None = None
        self.name: str | None = None  # "" for Nemo's JSON list

    def _head(self) -> bool:
        """Reads ``NAME[CALL_ID]ID[ARGS]`` or sees a JSON list; True once ``at`` is past it."""
        if self.raw.lstrip()[:1] == "[" and not self.raw.lstrip().startswith(("[A", "[C")):
            self.name = ""
            return True
        cut = self.raw.find("[")
        name = self.raw if cut < 0 else self.raw[:cut]
        if len(name) > _MAX_NAME or (name and not _NAME.fullmatch(name)) or cut == 0:
            self.status = "bad"
        if cut <= 0:
            return False
        tail = self.raw[cut:]
        if tail.startswith(CALL_ID):
            at = tail.find(ARGS)
            if at < 0:
                if len(tail) > _MAX_NAME:
                    self.status = "bad"
                return False
            self.call_id = tail[len(CALL_ID) : at]
            tail = tail[at:]
        if tail.startswith(ARGS):
            self.name = name
            self.at = len(self.raw) - len(tail) + len(ARGS)
            return True
        if not (ARGS.startswith(tail) or CALL_ID.startswith(tail)):
            self.status = "bad"
        return False

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        if self.name is None and not self._head():
            return []
        end = self._value_end()
        if end is None:
            return []
        value = load_json(self.raw[self.start : end])
        if self.name:
            value = [{"name": self.name, "arguments": value, "id": self.call_id}]
        events = self._emit(value if isinstance(value, list) else [value])
        if self.status != "bad":
            self.status = "done"
            self.rest = self.raw[end:]
        return events

    def finish(self) -> list[Event]:
        self.status = "bad"
        return []
