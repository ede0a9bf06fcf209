"""Qwen3-Coder / Qwen3.5 XML tool calls, streamed as they are written.

After ``<tool_call>``::

    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

The call is committed once ``<function=NAME>`` names one of the request's tools: then its start is
emitted and the arguments object is streamed. A parameter whose schema allows a string is
streamed as it is written (JSON-escaped, its first and last newline dropped, as the template
adds them); any other is converted once its ``</parameter>`` is read (the JSON value its text
parses to when the schema allows that type, else the text itself). Whatever breaks the syntax
after the commit closes the call there (the rest is content again), and so does the end of
the output: an emitted call is never taken back.
"""

from __future__ import annotations

import json
from typing import Any

from mgserve.api.chat_output.calls import CallParser, NewId
from mgserve.api.chat_output.events import Event, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from mgserve.api.chat_output.formats import schema_types
from mgserve.api.chat_output.markers import held_tail

FUNCTION, PARAMETER = "<function=", "<parameter="
END_PARAM, END_FUNCTION, END_CALL = "</parameter>", "</function>", "</tool_call>"
_MAX_NAME = 256

_CHECKS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: the JSON value it parses to when the schema
    allows that (any value when the schema says nothing), else the text as a string."""
    types = schema_types(schema)
    if "string" in types:
        return text
    if "boolean" in types and text.strip() in ("True", "False"):  # a template's `value | string`
        return text.strip() == "True"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python goes
        return text
    return value if not types or any(_CHECKS[t](value) for t in types if t in _CHECKS) else text


def _one_newline(text: str) -> str:
    return text[1:] if text.startswith("\n") else text


class XmlCall(CallParser):
    def __init__(
        self,
        index: int,
        names: Any,
        new_id: NewId,
        schemas: dict[str, dict[str, Any]],
    ) -> None:
        super().__init__(index, names, new_id)
        self.schemas = schemas  # tool name -> its parameters' schemas
        self.buf = ""  # text not yet consumed
        self.state = "head"  # head, between, value, tail
        self.props: dict[str, Any] = {}
        self.n_params = 0
        self.param = ""  # the parameter being read
        self.streaming = False  # its value is streamed as a JSON string
        self.started_value = False  # its first character (a newline to drop?) has been seen

    def _args(self, text: str) -> list[Event]:
        return [ToolCallArgsDelta(self.index, text)] if text else []

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        self.buf += text
        out: list[Event] = []
        steps = {"head": self._head, "between": self._between, "value": self._value}
        while self.status == "open":
            step = steps.get(self.state, self._tail)()
            if step is None:
                break
            out += step
        return out

    def _head(self) -> list[Event] | None:
        s = self.buf.lstrip()
        if len(s) < len(FUNCTION):
            if not FUNCTION.startswith(s):
                self.status = "bad"
            return None
        gt = s.find(">")
        if not s.startswith(FUNCTION) or (gt < 0 and len(s) > len(FUNCTION) + _MAX_NAME):
            self.status = "bad"
            return None
        if gt < 0:
            return None
        name = s[len(FUNCTION) : gt]
        if not self.known(name) or any(c.isspace() or c == "<" for c in name):
            self.status = "bad"
            return None
        self.props = self.schemas.get(name, {})
        self.n_calls = 1
        self.buf, self.state = s[gt + 1 :], "between"
        return [ToolCallStart(self.index, self.new_id(), name), ToolCallArgsDelta(self.index, "{")]

    def _close(self, rest: str) -> list[Event]:
        """Ends the call here; ``rest`` goes back to the caller as content."""
        self.status, self.rest = "done", rest
        return [ToolCallEnd(self.index)]

    def _between(self) -> list[Event] | None:
        s = self.buf.lstrip()
        if s.startswith(END_FUNCTION):
            self.buf, self.state = s[len(END_FUNCTION) :], "tail"
            return self._args("}")
        if s.startswith(PARAMETER):
            gt = s.find(">")
            if gt < 0:
                return None if len(s) <= len(PARAMETER) + _MAX_NAME else self._broken()
            self.param = s[len(PARAMETER) : gt]
            self.buf, self.state, self.started_value = s[gt + 1 :], "value", False
            self.streaming = "string" in schema_types(self.props.get(self.param))
            lead = (", " if self.n_params else "") + json.dumps(self.param, ensure_ascii=False)
            self.n_params += 1
            return self._args(lead + (': "' if self.streaming else ": "))
        if END_FUNCTION.startswith(s) or PARAMETER.startswith(s):
            return None
        return self._broken()

    def _broken(self) -> list[Event]:
        """Syntax broken after the commit: close what is open, the rest is content."""
        return self._args("}") + self._close(self.buf)

    def _value(self) -> list[Event] | None:
        if not self.started_value:
            if not self.buf:
                return None
            self.buf, self.started_value = _one_newline(self.buf), True
        at = self.buf.find(END_PARAM)
        if at < 0:
            if not self.streaming:
                return None
            hold = max(held_tail(self.buf, ["\n" + END_PARAM, END_PARAM]), 0)
            ready, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
            return self._args(json.dumps(ready, ensure_ascii=False)[1:-1]) or None
        value = self.buf[:at].removesuffix("\n")
        self.buf, self.state = self.buf[at + len(END_PARAM) :], "between"
        if self.streaming:
            return self._args(json.dumps(value, ensure_ascii=False)[1:-1] + '"')
        typed = typed_value(value, self.props.get(self.param))
        return self._args(json.dumps(typed, ensure_ascii=False))

    def _tail(self) -> list[Event] | None:
        s = self.buf.lstrip()
        if s.startswith(END_CALL):
            return self._close(s[len(END_CALL) :])
        if END_CALL.startswith(s):
            return None
        return self._close(self.buf)

    def finish(self) -> list[Event]:
        if self.status != "open" or self.state == "head":
            self.status = "bad" if self.status == "open" else self.status
            return []
        out: list[Event] = []
        if self.state == "value":
            value = self.buf.removesuffix("\n")
            if self.streaming:
                out += self._args(json.dumps(value, ensure_ascii=False)[1:-1] + '"')
            else:
                typed = typed_value(value, self.props.get(self.param))
                out += self._args(json.dumps(typed, ensure_ascii=False))
        if self.state != "tail":
            out += self._args("}")
        return out + self._close("")
