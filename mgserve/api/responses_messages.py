"""The Responses API's ``input`` -> the chat template's messages (OpenAI-style), checked.

A string is one user message; a list holds items:

- messages (``type`` ``message`` or none) of role ``user``, ``system``, ``developer`` or
  ``assistant``, their content a string or text parts (``input_text``, ``output_text``);
- ``function_call`` items become the tool calls of the assistant turn just before them (else of
  a turn of their own), ``function_call_output`` items ``tool`` messages;
- a ``reasoning`` item becomes the ``reasoning_content`` of the assistant turn after it (the
  template decides whether to render it).

The output items this server returns can be sent back as they are. Item references (stored
items), encrypted reasoning, images, files and audio, and any field the server would not honour
are a 400 naming where they are (``param`` "input"; the helpers here serve the other fields too).
"""

from __future__ import annotations

from typing import Any

from mgserve.api.errors import ApiError

ROLES = ("user", "system", "developer", "assistant")


def as_object(value: Any, where: str, param: str = "input") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError(f"{where} must be an object", param=param)
    return value


def check_keys(obj: dict[str, Any], allowed: set[str], where: str, param: str = "input") -> None:
    unknown = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if unknown:
        raise ApiError(f"{where}.{unknown[0]} is not supported by this server", param=param)


def string_of(obj: dict[str, Any], key: str, where: str, param: str = "input") -> str:
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
        kind = as_object(part, w).get("type")
        if kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(
                f"{w}: {kind} parts are not supported; this server's models read text only",
                param="input",
            )
        if kind not in ("input_text", "output_text"):
            raise ApiError(
                f"{w}: expected an input_text or output_text part, got {kind!r}", param="input"
            )
        check_keys(
            part, {"type", "text", "annotations", "logprobs"}, w
        )  # as output_text comes back
        out.append({"type": "text", "text": string_of(part, "text", w)})
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content's, else its summary's."""
    check_keys(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, where)
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
            if as_object(part, w).get("type") != kind:
                raise ApiError(f"{w} must be a {kind} part", param="input")
            check_keys(part, {"type", "text"}, w)
            texts.append(string_of(part, "text", w))
        if texts:
            break
    return "\n".join(texts)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_keys(item, {"type", "id", "call_id", "name", "arguments", "status"}, where)
    fn = {"name": string_of(item, "name", where), "arguments": string_of(item, "arguments", where)}
    return {"id": string_of(item, "call_id", where), "type": "function", "function": fn}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_keys(item, {"type", "id", "call_id", "output", "status"}, where)
    text = "\n".join(p["text"] for p in _parts(item.get("output"), where, "output"))
    return {"role": "tool", "tool_call_id": string_of(item, "call_id", where), "content": text}


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """``input`` as template messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": [{"type": "text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise ApiError("'input' must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = as_object(item, where).get("type") or "message"
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        if kind == "message":
            check_keys(item, {"type", "id", "role", "content", "status"}, where)
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
