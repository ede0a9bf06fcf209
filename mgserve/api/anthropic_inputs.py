"""Anthropic Messages requests -> the chat template's inputs (the OpenAI-style messages and tools
every template here is written for), checked.

- ``system`` (a string or text blocks) becomes the leading system message.
- A user turn's ``tool_result`` blocks become ``tool`` messages, in block order with its text.
- An assistant turn's ``tool_use`` blocks become its ``tool_calls`` (arguments as the JSON string
  OpenAI clients send; chat_messages.py parses them for templates that want objects), its
  ``thinking`` blocks its ``reasoning_content``.
- A trailing assistant turn of text is a prefill: the prompt ends with it and the answer continues
  it, as Anthropic's API does.
- ``tools`` become function tools; ``tool_choice`` ``none`` leaves them out of the prompt,
  ``any`` and ``tool`` force a call (as ``required`` and a named function do on
  /v1/chat/completions), ``disable_parallel_tool_use`` keeps one call;
  ``thinking`` sets the template's ``enable_thinking`` and the reasoning budget (``budget_tokens``;
  0 when disabled; the server's when adaptive or absent).

Anything the server would not honour (images, server tools, unknown block fields) is a 400
naming where it is. ``cache_control`` is accepted anywhere and changes nothing: every prompt's
cached prefix is reused without being asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from mgserve.api.chat_inputs import ChatInputs, forced_tool
from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields

MIN_THINKING_BUDGET = 1024  # Anthropic's lower limit on budget_tokens


@dataclass(frozen=True)
class MessagesInput:
    """What a /v1/messages request gives the template, and the text the answer continues."""

    chat: ChatInputs
    prefill: str  # a trailing assistant turn's text, appended to the rendered prompt
    budget: int  # the thinking budget asked for (api/reasoning.py; -1: the server's)


def _check_keys(obj: dict[str, Any], allowed: set[str], where: str, param: str) -> None:
    unknown = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if unknown:
        raise ApiError(f"{where}.{unknown[0]} is not supported by this server", param=param)


def _object(value: Any, where: str, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError(f"{where} must be an object", param=param)
    return value


def _string(obj: dict[str, Any], key: str, where: str, param: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{key} must be a string", param=param)
    return value


def _kind(block: Any, where: str, param: str) -> str:
    kind = _object(block, where, param).get("type")
    if not isinstance(kind, str):
        raise ApiError(f"{where}.type must be a string", param=param)
    if kind in ("image", "document"):
        raise ApiError(
            f"{where}: {kind} blocks are not supported; this server's models read text only",
            param=param,
        )
    return kind


def _text_part(block: Any, where: str, param: str) -> dict[str, str]:
    kind = _kind(block, where, param)
    if kind != "text":
        raise ApiError(f"{where}: expected a text block, got {kind!r}", param=param)
    _check_keys(block, {"type", "text", "cache_control"}, where, param)
    return {"type": "text", "text": _string(block, "text", where, param)}


def _text_parts(content: Any, where: str, param: str) -> list[dict[str, str]]:
    """A string or a list of text blocks, as the template's text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of text blocks", param=param)
    return [_text_part(b, f"{where}[{i}]", param) for i, b in enumerate(content)]


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    keys = {"type", "tool_use_id", "content", "is_error", "cache_control"}
    _check_keys(block, keys, where, "messages")
    content = block.get("content")
    parts = [] if content is None else _text_parts(content, f"{where}.content", "messages")
    text = "\n".join(p["text"] for p in parts)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise ApiError(f"{where}.is_error must be a boolean", param="messages")
    if is_error:  # a message has no field for a failed call: the result says so in words
        text = "Error: " + text
    tool_use_id = _string(block, "tool_use_id", where, "messages")
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(blocks):
        w = f"{where}.content[{j}]"
        kind = _kind(block, w, "messages")
        if kind == "text":
            parts.append(_text_part(block, w, "messages"))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, w))
        else:
            raise ApiError(
                f"{w}: block type {kind!r} is not supported in a user turn", param="messages"
            )
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    parts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(blocks):
        w = f"{where}.content[{j}]"
        kind = _kind(block, w, "messages")
        if kind == "text":
            parts.append(_text_part(block, w, "messages"))
        elif kind == "thinking":  # its signature is Anthropic's; nothing here checks one
            _check_keys(block, {"type", "thinking", "signature"}, w, "messages")
            thinking.append(_string(block, "thinking", w, "messages"))
        elif kind == "tool_use":
            _check_keys(block, {"type", "id", "name", "input", "cache_control"}, w, "messages")
            args = _object(block.get("input"), f"{w}.input", param="messages")
            fn = {"name": _string(block, "name", w, "messages"), "arguments": json.dumps(args)}
            calls.append({"id": _string(block, "id", w, "messages"), "type": "function"})
            calls[-1]["function"] = fn
        else:
            raise ApiError(
                f"{w}: block type {kind!r} is not supported in an assistant turn", param="messages"
            )
    msg: dict[str, Any] = {"role": "assistant", "content": parts}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def _messages(raw: Any) -> tuple[list[dict[str, Any]], str]:
    """The conversation as template messages, and the trailing assistant text (the prefill)."""
    if not isinstance(raw, list) or not raw:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    prefill = ""
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        _check_keys(_object(m, where, "messages"), {"role", "content"}, where, "messages")
        role, content = m.get("role"), m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ApiError(
                f"{where}.content must be a string or a list of blocks", param="messages"
            )
        if role == "user":
            out.extend(_user(content, where))
        elif role == "system":
            out.append({"role": "system", "content": _text_parts(content, where, "messages")})
        elif role == "assistant" and i == len(raw) - 1:
            if any(isinstance(b, dict) and b.get("type") != "text" for b in content):
                raise ApiError(
                    f"{where}: a trailing assistant turn (a prefill) may hold text blocks only",
                    param="messages",
                )
            prefill = "".join(p["text"] for p in _text_parts(content, where, "messages"))
        elif role == "assistant":
            out.append(_assistant(content, where))
        else:
            raise ApiError(
                f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}",
                param="messages",
            )
    return out, prefill


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ApiError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = _object(tool, where, "tools").get("type")
        if kind not in (None, "custom"):
            raise ApiError(
                f"{where}: tool type {kind!r} is not supported (Anthropic's server tools run on "
                "its side); this server takes custom tools: name, description, input_schema",
                param="tools",
            )
        _check_keys(
            tool, {"type", "name", "description", "input_schema", "cache_control"}, where, "tools"
        )
        fn: dict[str, Any] = {"name": _string(tool, "name", where, "tools")}
        if tool.get("description") is not None:
            fn["description"] = _string(tool, "description", where, "tools")
        fn["parameters"] = _object(tool.get("input_schema"), f"{where}.input_schema", "tools")
        out.append({"type": "function", "function": fn})
    return out


class _Choice(NamedTuple):
    rendered: bool  # the tools go into the prompt (``none``: not)
    choice: str  # ChatInputs.tool_choice: "auto" or "required"
    name: str | None  # ``tool``: the one tool that may be called
    parallel: bool  # not disable_parallel_tool_use


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> _Choice:
    """``auto``, ``none``, ``any`` (a call of any tool is forced) or ``tool`` (a call of the
    one it names); ``disable_parallel_tool_use``: one call at most (forced: exactly one)."""
    if raw is None:
        return _Choice(True, "auto", None, True)
    kind = _object(raw, "tool_choice", param="tool_choice").get("type")
    if kind not in ("auto", "none", "any", "tool"):
        raise ApiError(
            f"tool_choice.type {kind!r} is not one of auto, none, any, tool", param="tool_choice"
        )
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    _check_keys(raw, keys, "tool_choice", param="tool_choice")
    parallel = not Fields(raw).get_bool("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return _Choice(kind == "auto", "auto", None, parallel)
    name = _string(raw, "name", "tool_choice", "tool_choice") if kind == "tool" else None
    forced_tool(tools, name, "tool_choice")
    return _Choice(True, "required", name, parallel)


def _thinking(raw: Any, max_tokens: int | None, switch: bool) -> tuple[dict[str, Any], int]:
    """``thinking`` -> the template's ``enable_thinking`` and the budget (-1: the server's).
    budget_tokens is checked as Anthropic checks it."""
    if raw is None:
        return {}, -1
    kind = _object(raw, "thinking", "thinking").get("type")
    if kind == "disabled":
        _check_keys(raw, {"type"}, "thinking", "thinking")
        return {"enable_thinking": False} if switch else {}, 0
    if kind not in ("enabled", "adaptive"):
        raise ApiError(
            f"thinking.type {kind!r} is not supported (enabled, adaptive or disabled)",
            param="thinking",
        )
    if not switch:
        raise ApiError(
            "thinking: this model's chat template has no thinking switch (enable_thinking)",
            param="thinking",
        )
    budget = -1  # adaptive: the model decides how much to think, within the server's budget
    if kind == "enabled":
        _check_keys(raw, {"type", "budget_tokens"}, "thinking", "thinking")
        budget = Fields(raw).get_int("budget_tokens", -1)
        if budget < MIN_THINKING_BUDGET or (max_tokens is not None and budget >= max_tokens):
            raise ApiError(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than "
                f"max_tokens, got {budget}",
                param="thinking",
            )
    else:
        _check_keys(raw, {"type"}, "thinking", "thinking")
    return {"enable_thinking": True}, budget


def messages_input(body: dict[str, Any], thinking_switch: bool) -> MessagesInput:
    """/v1/messages and /v1/messages/count_tokens: the template's inputs, checked.
    ``thinking_switch``: whether the chat template reads ``enable_thinking``."""
    system = body.get("system")
    messages, prefill = _messages(body.get("messages"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": _text_parts(system, "system", "system")})
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    max_tokens = Fields(body).get_int("max_tokens", 0) or None  # none on count_tokens
    kwargs, budget = _thinking(body.get("thinking"), max_tokens, thinking_switch)
    # tool_use blocks come from the calls the chat output parser reads (none without tools);
    # thinking blocks from the reasoning it splits out (the server's reasoning format)
    rendered = tools if choice.rendered else None
    chat = ChatInputs(
        messages, rendered, kwargs, True, choice.choice, choice.name, choice.parallel, None
    )
    return MessagesInput(chat, prefill, budget)
