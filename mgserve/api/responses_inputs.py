"""OpenAI Responses requests -> the chat template's inputs (the OpenAI-style messages and tools
every template here is written for), checked.

- ``instructions`` is the leading system message (joined to a system or developer message that
  opens ``input``: templates take one).
- ``input`` is a string (one user message) or a list of items:
  messages (``type`` ``message`` or none) of role ``user``, ``system``, ``developer`` or
  ``assistant``, their content a string or text parts (``input_text``, ``output_text``);
  ``function_call`` items become the tool calls of the assistant turn just before them (else of a
  turn of their own), ``function_call_output`` items ``tool`` messages; a ``reasoning`` item
  becomes the ``reasoning_content`` of the assistant turn after it (the template decides whether
  to render it). The output items this server returns can be sent back as they are.
- ``tools`` are function tools (name, description, parameters, strict); ``strict`` is accepted but
  the arguments are not held to the schema (they are read as a JSON object, as on
  /v1/chat/completions). ``tool_choice`` ``auto`` or ``none`` (tools rendered, no call read).
- ``reasoning.effort`` switches the template's thinking: ``none`` off, ``medium`` (OpenAI's
  default) on, the model thinking as much as it does. Other efforts need a thinking budget and
  ``summary`` a summarizer, which this server does not have: a 400.

Nothing is stored, so ``previous_response_id``, ``store: true`` and item references are refused;
so are images, files and audio (text only) and anything else the server would not honour, with a
400 naming where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mgserve.api.chat_inputs import ChatInputs
from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields

ROLES = ("user", "system", "developer", "assistant")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True)
class ResponsesInput:
    """What a /v1/responses request gives the template, and what the response echoes."""

    chat: ChatInputs
    effort: str | None  # reasoning.effort as asked


def _object(value: Any, where: str, param: str = "input") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError(f"{where} must be an object", param=param)
    return value


def _keys(obj: dict[str, Any], allowed: set[str], where: str, param: str = "input") -> None:
    unknown = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if unknown:
        raise ApiError(f"{where}.{unknown[0]} is not supported by this server", param=param)


def _str(obj: dict[str, Any], key: str, where: str, param: str = "input") -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key} must be a string", param=param)
    return value


def _parts(content: Any, where: str, field: str = "content") -> list[dict[str, str]]:
    """A string or a list of text parts, as the template's text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(f"{where}.{field} must be a string or a list of text parts", param="input")
    out = []
    for j, part in enumerate(content):
        w = f"{where}.{field}[{j}]"
        kind = _object(part, w).get("type")
        if kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(
                f"{w}: {kind} parts are not supported; this server's models read text only",
                param="input",
            )
        if kind not in ("input_text", "output_text"):
            raise ApiError(
                f"{w}: expected an input_text or output_text part, got {kind!r}", param="input"
            )
        _keys(part, {"type", "text", "annotations", "logprobs"}, w)  # as output_text comes back
        out.append({"type": "text", "text": _str(part, "text", w)})
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content's, else its summary's."""
    _keys(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, where)
    if item.get("encrypted_content") is not None:
        raise ApiError(
            f"{where}.encrypted_content: this server issues no encrypted reasoning; send the "
            "reasoning item as it came (its content)",
            param="input",
        )
    texts = []
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise ApiError(f"{where}.{key} must be a list", param="input")
        for j, part in enumerate(parts):
            w = f"{where}.{key}[{j}]"
            if _object(part, w).get("type") != kind:
                raise ApiError(f"{w} must be a {kind} part", param="input")
            _keys(part, {"type", "text"}, w)
            texts.append(_str(part, "text", w))
        if texts:
            break
    return "\n".join(texts)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, {"type", "id", "call_id", "name", "arguments", "status"}, where)
    fn = {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}
    return {"id": _str(item, "call_id", where), "type": "function", "function": fn}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, {"type", "id", "call_id", "output", "status"}, where)
    text = "\n".join(p["text"] for p in _parts(item.get("output"), where, "output"))
    return {"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": text}


def _messages(raw: Any) -> list[dict[str, Any]]:
    """``input`` as template messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": [{"type": "text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise ApiError("'input' must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = _object(item, where).get("type", "message")
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        if kind == "message":
            _keys(item, {"type", "id", "role", "content", "status"}, where)
            role = item.get("role")
            if role not in ROLES:
                raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}", param="input")
            msg = {"role": role, "content": _parts(item.get("content"), where)}
        elif kind == "function_call":
            call = _call(item, where)
            last = out[-1] if out else {}
            if last.get("role") == "assistant" and not reasoning:  # the turn the call ends
                last.setdefault("tool_calls", []).append(call)
                continue
            msg = {"role": "assistant", "content": [], "tool_calls": [call]}
        elif kind == "function_call_output":
            msg = _call_output(item, where)
        elif kind == "item_reference":
            raise ApiError(
                f"{where}: item references need stored responses, which this server does not "
                "keep; send the items themselves",
                param="input",
            )
        else:
            raise ApiError(
                f"{where}: item type {kind!r} is not supported (this server takes message, "
                "function_call, function_call_output and reasoning items)",
                param="input",
            )
        if reasoning:
            if msg["role"] != "assistant":
                raise ApiError(
                    f"{where}: a reasoning item must come just before the assistant message or "
                    "function call it belongs to",
                    param="input",
                )
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
        out.append(msg)
    if reasoning:
        raise ApiError(
            "input: the last item is reasoning without the answer it belongs to", param="input"
        )
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ApiError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = _object(tool, where, "tools").get("type")
        if kind != "function":
            raise ApiError(
                f"{where}: tool type {kind!r} is not supported (OpenAI's hosted tools run on its "
                "side); this server takes function tools: name, description, parameters",
                param="tools",
            )
        _keys(tool, {"type", "name", "description", "parameters", "strict"}, where, "tools")
        fn: dict[str, Any] = {"name": _str(tool, "name", where, "tools")}
        if tool.get("description") is not None:
            fn["description"] = _str(tool, "description", where, "tools")
        if tool.get("parameters") is not None:
            fn["parameters"] = _object(tool["parameters"], f"{where}.parameters", "tools")
        if not isinstance(tool.get("strict"), bool | None):
            raise ApiError(f"{where}.strict must be a boolean", param="tools")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> str:
    if raw is None or raw in ("auto", "none"):
        return raw or "auto"
    named = isinstance(raw, dict) and raw.get("type") == "function"
    if raw == "required" or named:
        what = "'required'" if raw == "required" else "a named function"
        raise ApiError(
            f"tool_choice {what} is not supported yet: forcing a tool call needs constrained "
            "decoding of the call, which this server does not do yet; use 'auto' or 'none'",
            param="tool_choice",
        )
    kind = raw.get("type") if isinstance(raw, dict) else raw
    raise ApiError(
        f"tool_choice {kind!r} is not supported (this server takes 'auto' or 'none')",
        param="tool_choice",
    )


def _reasoning(raw: Any, switch: bool, thinks: bool) -> tuple[dict[str, Any], str | None]:
    """``reasoning`` -> the template's kwargs and the effort asked. ``switch``: the template reads
    ``enable_thinking``; ``thinks``: it has a reasoning block at all."""
    if raw is None:
        return {}, None
    obj = _object(raw, "reasoning", "reasoning")
    _keys(obj, {"effort", "summary", "generate_summary"}, "reasoning", "reasoning")
    for key in ("summary", "generate_summary"):
        if obj.get(key) is not None:
            raise ApiError(
                f"reasoning.{key}: this server does not summarize reasoning; the reasoning comes "
                "whole, as a reasoning item's content",
                param="reasoning",
            )
    effort = obj.get("effort")
    if effort is None:
        return {}, None
    if effort not in EFFORTS:
        raise ApiError(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
            param="reasoning",
        )
    if effort not in ("none", "medium"):
        raise ApiError(
            f"reasoning.effort {effort!r} is not supported: this server has no reasoning budget; "
            "'medium' lets the model reason as it does, 'none' turns reasoning off",
            param="reasoning",
        )
    if effort == "medium" and not thinks:
        raise ApiError(
            "reasoning.effort: this model does not reason (its chat template has no reasoning "
            "block); leave reasoning out or send effort 'none'",
            param="reasoning",
        )
    if switch:
        return {"enable_thinking": effort == "medium"}, effort
    if effort == "none" and thinks:
        raise ApiError(
            "reasoning.effort 'none': this model's chat template has no thinking switch "
            "(enable_thinking), so it always reasons",
            param="reasoning",
        )
    return {}, effort


def _stateless(body: dict[str, Any]) -> None:
    """The fields that would need responses kept on the server, or that change nothing here."""
    if body.get("previous_response_id") is not None:
        raise ApiError(
            "previous_response_id needs responses stored on the server, which this server does "
            "not keep; send the whole conversation in 'input'",
            param="previous_response_id",
        )
    if Fields(body).get_bool("store", False):
        raise ApiError(
            "store: true is not supported (this server keeps no responses); send store: false "
            "or leave it out",
            param="store",
        )
    if Fields(body).get_str("truncation", "disabled") != "disabled":
        raise ApiError(
            "truncation 'auto' is not supported: a prompt longer than the context is a 400",
            param="truncation",
        )
    opts = _object(body.get("stream_options") or {}, "stream_options", "stream_options")
    _keys(opts, {"include_obfuscation"}, "stream_options", "stream_options")
    if opts.get("include_obfuscation") not in (None, False):
        raise ApiError(
            "stream_options.include_obfuscation: only false is supported (stream events carry "
            "no obfuscation padding)",
            param="stream_options",
        )
    meta = _object(body.get("metadata") or {}, "metadata", "metadata")
    if not all(isinstance(v, str) for v in meta.values()):
        raise ApiError("metadata values must be strings", param="metadata")
    text = _object(body.get("text") or {}, "text", "text")  # its format: structured.py
    _keys(text, {"format", "verbosity"}, "text", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError("text.verbosity: only 'medium' (the model's own) is supported", param="text")


def responses_input(body: dict[str, Any], switch: bool, thinks: bool) -> ResponsesInput:
    """/v1/responses: the template's inputs, checked. ``switch``: the chat template reads
    ``enable_thinking``; ``thinks``: it has a reasoning block."""
    _stateless(body)
    messages = _messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("'instructions' must be a string", param="instructions")
        part = {"type": "text", "text": instructions}
        if messages[0]["role"] in ("system", "developer"):
            messages[0]["content"].insert(0, part)
        else:
            messages.insert(0, {"role": "system", "content": [part]})
    kwargs, effort = _reasoning(body.get("reasoning"), switch, thinks)
    parallel = Fields(body).get_bool("parallel_tool_calls", True)
    tools, choice = _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))
    return ResponsesInput(ChatInputs(messages, tools, kwargs, True, choice, parallel, None), effort)
