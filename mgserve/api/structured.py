"""Structured output fields -> the request's compiled grammar (core/grammar).

OpenAI's ``response_format`` (json_object, json_schema), the Responses API's ``text.format`` (the
same, with the json_schema fields flat in the format), and llama-server's ``json_schema`` and
``grammar`` (GBNF); which route takes which is fields.py's business. At most one of them per
request, and none with a forced tool call (``tool_choice`` required or named, Anthropic's any or
tool), whose grammar (tool_grammar.py) is built once the prompt is rendered. Compiling runs off
the event loop and is cached by the grammar's text; a schema or grammar that does not compile is
a 400 naming its field.
"""

from __future__ import annotations

from typing import Any

from mgserve.api.chat_inputs import ChatInputs
from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields
from mgserve.api.service import Service
from mgserve.api.tool_grammar import forced_calls, mistral_layout, think_state
from mgserve.core.grammar import Grammar, GrammarError, GrammarSpec
from mgserve.core.grammar.vocab import is_special


def _schema(v: Any, param: str) -> GrammarSpec:
    if not isinstance(v, dict | bool):
        raise ApiError(f"'{param}' must be a JSON schema (an object)", param=param)
    return GrammarSpec.json_schema(v)


def _response_format(fmt: Any, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format: text, json_object (llama-server: with an optional ``schema``)
    or json_schema {name, schema, strict}; the schema is enforced whatever ``strict`` says.
    ``param`` "text": the Responses API's text.format, whose json_schema fields are its own."""
    if not isinstance(fmt, dict):
        raise ApiError(f"'{param}' must be an object", param=param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _schema(fmt.get("schema") or {"type": "object"}, param)
    if kind != "json_schema":
        raise ApiError(
            f"response_format type {kind!r} is not supported "
            "(use 'text', 'json_object' or 'json_schema')",
            param=param,
        )
    where = "text.format" if param == "text" else "response_format.json_schema"
    js = fmt if param == "text" else fmt.get("json_schema")
    if not isinstance(js, dict) or js.get("schema") is None:
        raise ApiError(f"{where} must be an object with a 'schema'", param=param)
    strict, name = js.get("strict"), js.get("name")
    if not isinstance(strict, bool | None) or not isinstance(name, str | None):
        raise ApiError(f"{where}: 'strict' must be a boolean and 'name' a string", param=param)
    return _schema(js["schema"], param)


def grammar_spec(body: dict[str, Any]) -> tuple[GrammarSpec, str] | None:
    """The request's output constraint and the field that gave it: ``response_format``,
    ``text.format``, llama-server's ``json_schema`` or ``grammar`` (GBNF; "" is none). The route's
    fields.py entry says which of them it takes."""
    found: list[tuple[GrammarSpec, str]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append((spec, "response_format"))
    text = body.get("text")
    if isinstance(text, dict) and text.get("format") is not None:  # the route checks the rest
        spec = _response_format(text["format"], "text")
        if spec is not None:
            found.append((spec, "text"))
    if body.get("json_schema") is not None:
        found.append((_schema(body["json_schema"], "json_schema"), "json_schema"))
    gbnf = Fields(body).get_str("grammar", "")
    if gbnf:
        found.append((GrammarSpec("gbnf", gbnf), "grammar"))
    if len(found) > 1:
        raise ApiError(
            f"'{found[0][1]}' and '{found[1][1]}' both constrain the output; give one",
            param=found[1][1],
        )
    return found[0] if found else None


async def compile_grammar(service: Service, spec: GrammarSpec, param: str) -> Grammar:
    """``spec`` compiled off the event loop (cached by its text); one that does not compile is a
    400 naming ``param``."""
    try:
        return await service.grammars.compile_async(spec)
    except GrammarError as e:
        raise ApiError(f"invalid {param}: {e}", param=param) from None


async def request_grammar(
    service: Service, body: dict[str, Any], forced: bool = False
) -> Grammar | None:
    """The request's grammar; ``forced``: a tool call is forced, so there may be none."""
    found = grammar_spec(body)
    if found is None:
        return None
    if forced:
        raise ApiError(
            f"a forced tool call (tool_choice) and '{found[1]}' both constrain the output; "
            "give one",
            param=found[1],
        )
    return await compile_grammar(service, *found)


def _after_engine_hold(state: str) -> str:
    """The engine holds a grammar back until a reasoning block the prompt opened is closed
    (core/engine/reasoning.py: by the model, or forced by the budget), so the calls' grammar
    starts after it: the block is no part of it."""
    return "none" if state == "open" else state


def forced_call_spec(service: Service, inputs: ChatInputs, prompt: str) -> GrammarSpec | None:
    """The grammar of the calls ``inputs`` force (None when they force none), after ``prompt``
    (the rendered prompt: whether it opened or closed a reasoning block)."""
    if inputs.tool_choice != "required":
        return None
    assert inputs.tools, "chat_inputs checks that forced calls have tools"
    tok = service.tokenizer

    def special(marker: str) -> int | None:
        tid = tok.token_id(marker)
        return tid if tid is not None and is_special(tok, tid) else None

    fmt = service.chat_format
    text = forced_calls(
        fmt,
        [t for t in inputs.tools if inputs.tool_name in (None, t["function"]["name"])],
        parallel=inputs.parallel_tool_calls,
        think=_after_engine_hold(think_state(fmt, prompt)),
        special=special,
        mistral=mistral_layout(service.chat.source),
    )
    return GrammarSpec("lark", text)
