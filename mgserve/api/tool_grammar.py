"""Forced tool calls: the grammar (llguidance's Lark syntax) that holds a model's whole answer to
tool calls in its template's syntax, each call's arguments held to the tool's JSON schema.

``tool_choice`` ``required`` (Anthropic's ``any``) allows any of the request's tools, a named
function (Anthropic's ``tool``) only that one; one call, or one or more when parallel calls are
allowed (Llama 3's format writes one). Nothing but the calls is allowed, except a reasoning block
where the template opens one: when the prompt ends inside it, free text up to its closing marker
comes first; when the template lets the model open one (the prompt neither opened nor closed it),
it may come first. The model decides how long it reasons. The layouts are the ones the templates
write (tests/api/test_tool_grammar.py checks them against the templates' own renderings):

- ``xml``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>``, parameters in the schema's order (the required ones always). A
  parameter the parser reads as a string (its schema allows one) is raw text, held to the schema's
  ``enum`` / ``const`` and length bounds (a ``pattern`` or ``format`` there cannot be enforced on
  raw text and is refused); any other is JSON under its schema (``True`` / ``False`` too for a
  plain boolean, as the templates write them);
- ``hermes``: ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``;
- ``llama3``: ``{"name": NAME, "parameters": ARGS}``;
- ``mistral``: ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]ARGS`` (Small 3.2), ``[TOOL_CALLS]NAME[ARGS]ARGS``
  (Devstral), or ``[TOOL_CALLS][{"name": NAME, "arguments": ARGS, "id": ID}, ...]`` (Nemo), as the
  template's source shows; ids are 9 letters and digits.

The arguments have no properties beyond the ones their schema lists, unless it allows them with
``additionalProperties`` (in the XML syntax, never).

A marker that is one special token of the vocabulary is that token (``<[id]>``): its text is not
something the model can spell.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mgserve.api.chat_output import ChatFormat
from mgserve.api.chat_output.formats import schema_types
from mgserve.api.errors import ApiError
from mgserve.core.grammar.compiler import JSON_OPTIONS

SpecialId = Callable[[str], int | None]  # a marker's id when it is one special token, else None

_EMPTY_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
_ANY = "(?s:.*)"
_SEP = "/[ \\n]{0,2}/"  # between a closed reasoning block and the calls (templates write "\n\n")
_ID = "/[A-Za-z0-9]{9}/"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _rx(text: str) -> str:
    """``text`` as a regex matching it literally (every other character hex-escaped)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def _until(marker: str, lo: int = 0, hi: int | None = None, avoid: str = "") -> str:
    """A terminal: text of lo..hi characters, then ``marker``; ``avoid`` (the marker if not
    given, else a tail of it) comes nowhere before that."""
    bound = "*" if (lo, hi) == (0, None) else f"{{{lo},{'' if hi is None else hi}}}"
    return f"/(?s:.{bound}){_rx(marker)}/ & ~/{_ANY}{_rx(avoid or marker)}(?s:.+)/"


class _Builder:
    def __init__(self, fmt: ChatFormat, special: SpecialId) -> None:
        self.fmt = fmt
        self.special = special
        self.rules: list[str] = []

    def mark(self, text: str) -> str:
        tid = self.special(text)
        return _lit(text) if tid is None else f"<[{tid}]>"

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def json(self, schema: Any) -> str:
        return "%json " + json.dumps({"x-guidance": JSON_OPTIONS} | schema, ensure_ascii=False)

    def think(self, state: str) -> str:
        """The grammar's head: ``open`` (the prompt opened the reasoning block), ``free`` (the
        model may open one) or ``none``."""
        if state == "none" or self.fmt.think is None:
            return ""
        opening, closing = self.fmt.think
        if self.special(closing) is None:
            body = self.rule("THINK", _until(closing))
        else:
            body = f"/{_ANY}/ {self.mark(closing)}"
        if state == "open":
            return self.rule("think", f"{body} {_SEP}") + " "
        return self.rule("think", f"{self.mark(opening)} {body} {_SEP}") + "? "


def _args_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """The arguments' schema; properties it does not list are not written unless it says
    ``additionalProperties`` (as in OpenAI's strict function calling and llama.cpp)."""
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        return _EMPTY_ARGS
    if "properties" in params and "additionalProperties" not in params:
        return params | {"additionalProperties": False}
    return params


def _xml_string(b: _Builder, name: str, rule: str, schema: dict[str, Any]) -> str:
    """A raw-text parameter value and its closing line."""
    for key in ("pattern", "format"):
        if key in schema:
            raise ApiError(
                f"parameter {name!r} has a '{key}', which the template's XML tool-call syntax "
                "(raw text values) cannot enforce; tool_choice 'auto' enforces no schema",
                param="tools",
            )
    choices = schema.get("enum", [schema["const"]] if "const" in schema else [])
    choices = choices if isinstance(choices, list) else []
    words = [v for v in choices if isinstance(v, str) and "</parameter>" not in v]
    if words:
        return "(" + " | ".join(_lit(w) for w in words) + ') "\\n</parameter>\\n"'
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    value = _until("\n</parameter>", lo, hi, avoid="</parameter>")
    return b.rule(rule.upper(), value) + ' "\\n"'


def _xml_value(b: _Builder, name: str, rule: str, schema: Any, defs: dict[str, Any]) -> str:
    schema = schema if isinstance(schema, dict) else {}
    types = schema_types(schema)
    if "string" in types:
        return _xml_string(b, name, rule, schema)
    if types == {"boolean"} and not schema.keys() & {"enum", "const"}:
        value = '("true" | "false" | "True" | "False")'
    else:
        value = b.json(defs | schema)
    return value + ' "\\n</parameter>\\n"'


def _xml_call(b: _Builder, i: int, fn: dict[str, Any]) -> str:
    params = _args_schema(fn)
    props = params.get("properties")
    props = props if isinstance(props, dict) else {}
    required = params.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    defs: dict[str, Any] = {k: params[k] for k in ("$defs", "definitions") if k in params}
    parts = [_lit(f"<function={fn['name']}>\n")]
    for j, (name, schema) in enumerate(props.items()):
        value = _xml_value(b, name, f"v{i}_{j}", schema, defs)
        opening = _lit(f"<parameter={name}>\n")
        p = b.rule(f"p{i}_{j}", f"{opening} {value}")
        parts.append(p if name in required else p + "?")
    return " ".join([*parts, _lit("</function>")])


def _json_call(b: _Builder, fn: dict[str, Any], key: str, tail: str = "") -> str:
    head = _lit(f'{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "{key}": ')
    return f"{head} {b.json(_args_schema(fn))} {tail}{_lit('}')}"


def mistral_layout(source: str) -> str:
    """``call_id``, ``args`` or ``list``: which of Mistral's call layouts the template writes."""
    if "[ARGS]" in source:
        return "call_id" if "[CALL_ID]" in source else "args"
    return "list"


def think_state(fmt: ChatFormat, prompt: str) -> str:
    """``open`` when ``prompt`` ends inside a reasoning block, ``none`` when it closed one (or the
    template has none), else ``free``: the model may open one."""
    if fmt.think is None:
        return "none"
    tail = prompt.rstrip()
    return (
        "open" if tail.endswith(fmt.think[0]) else "none" if tail.endswith(fmt.think[1]) else "free"
    )


def _alternatives(b: _Builder, calls: list[str]) -> str:
    return " | ".join(b.rule(f"f{i}", c) for i, c in enumerate(calls))


def forced_calls(
    fmt: ChatFormat,
    tools: list[dict[str, Any]],
    *,
    parallel: bool,
    think: str,
    special: SpecialId,
    mistral: str = "list",
) -> str:
    """The Lark grammar of an answer of forced calls of ``tools`` (the ones allowed: all of the
    request's, or the named one); ``think`` as ``_Builder.think`` takes it; ``mistral``:
    ``mistral_layout`` of the template."""
    b = _Builder(fmt, special)
    fns = [t["function"] for t in tools]
    kind = fmt.tools
    if kind == "mistral" and mistral == "list":
        tail = f'", \\"id\\": \\"" {_ID} "\\"" '
        b.rule("call", _alternatives(b, [_json_call(b, fn, "arguments", tail) for fn in fns]))
        more = ' (", " call)*' if parallel else ""
        calls = f'{b.mark("[TOOL_CALLS]")} "[" call{more} "]"'
    else:
        if kind == "xml":
            each = [_xml_call(b, i, fn) for i, fn in enumerate(fns)]
        elif kind in ("hermes", "llama3"):
            key = "arguments" if kind == "hermes" else "parameters"
            each = [_json_call(b, fn, key) for fn in fns]
        elif kind == "mistral":
            cid = f"{b.mark('[CALL_ID]')} {_ID} " if mistral == "call_id" else ""
            each = [
                f"{_lit(fn['name'])} {cid}{b.mark('[ARGS]')} {b.json(_args_schema(fn))}"
                for fn in fns
            ]
        else:
            raise AssertionError(f"no tool-call syntax in format {kind!r}")
        call = _alternatives(b, each)
        if kind in ("xml", "hermes"):
            call = f'{b.mark("<tool_call>")} "\\n" ({call}) "\\n" {b.mark("</tool_call>")}'
        elif kind == "mistral":
            call = f"{b.mark('[TOOL_CALLS]')} ({call})"
        b.rule("call", call)
        sep = '"\\n" ' if kind in ("xml", "hermes") else ""
        calls = f"call ({sep}call)*" if parallel and kind != "llama3" else "call"
    start = f"start: {b.think(think)}{calls}"
    return "\n".join([start, *b.rules]) + "\n"
