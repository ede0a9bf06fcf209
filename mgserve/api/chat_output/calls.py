"""What the tool-call parsers share: their protocol, JSON spans and checking a call object.

A call parser gets the text after its format's start marker, piece by piece. It stays ``open``
until it has read a whole call (``done``; ``rest`` is the text after it) or knows the text is no
call (``bad``: nothing was emitted, and the caller turns the text back into content). Once it has
emitted a ``ToolCallStart`` it is committed: whatever follows, it closes that call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from mgserve.api.chat_output.events import (
    Event,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

NewId = Callable[[], str]


class CallParser:
    """Base of the format parsers: status, the text fed so far, the text after the call."""

    def __init__(self, index: int, names: Collection[str] | None, new_id: NewId) -> None:
        self.index = index  # the index of the first call this parser reads
        self.n_calls = 0  # calls emitted so far
        self.names = names  # the request's tool names (None: any name)
        self.new_id = new_id
        self.status = "open"  # "open", "done" or "bad"
        self.raw = ""  # everything fed: on "bad", the caller re-reads it as content
        self.rest = ""  # on "done": what came after the call

    def known(self, name: Any) -> bool:
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def whole_call(self, name: str, args: str, call_id: str | None = None) -> list[Event]:
        """The events of one call read at once."""
        i = self.index + self.n_calls
        self.n_calls += 1
        return [
            ToolCallStart(i, call_id or self.new_id(), name),
            ToolCallArgsDelta(i, args),
            ToolCallEnd(i),
        ]

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


class JsonSpan:
    """Where a JSON object or array that starts a text ends, found incrementally: each ``scan``
    of the grown text resumes where the last one stopped."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """The index just past the value's end, or None while it is still open."""
        i = self.pos
        while i < len(text):
            c = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


class Call(NamedTuple):
    name: str
    arguments: str  # a JSON object, as a string
    id: str | None  # the model's own id, where its format writes one


def arguments_json(args: Any) -> str | None:
    """Arguments as OpenAI's JSON string: an object, or a string holding one; None otherwise."""
    try:
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python goes
        return None


def call_from(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """``{"name": ..., "arguments" | "parameters": {...}, ["id": ...]}`` as a Call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    present = [k for k in keys if k in obj]
    args = arguments_json(obj[present[0]]) if present else "{}"
    if args is None:
        return None
    call_id = obj.get("id")
    return Call(obj["name"], args, call_id if isinstance(call_id, str) and call_id else None)


def load_json(text: str) -> Any:
    """The JSON value of ``text``, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
