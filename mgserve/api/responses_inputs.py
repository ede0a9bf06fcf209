"""OpenAI Responses requests -> the chat template's inputs (the OpenAI-style messages and tools
every template here is written for), checked.

- ``input`` becomes the messages (responses_messages.py); ``instructions`` the leading system
  message (joined to a system or developer message that opens ``input``: templates take one).
- ``tools`` are function tools (name, description, parameters, strict); ``strict`` is accepted but
  the arguments are not held to the schema (they are read as a JSON object, as on
  /v1/chat/completions). ``tool_choice`` ``auto`` or ``none`` (tools rendered, no call read).
- ``reasoning.effort`` switches the template's thinking: ``none`` off, ``medium`` (OpenAI's
  default) on, the model thinking as much as it does. Other efforts need a thinking budget and
  ``summary`` a summarizer, which this server does not have: a 400.

Nothing is stored, so ``previous_response_id`` and ``store: true`` are refused, as is anything
else the server would not honour, with a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mgserve.api.chat_inputs import ChatInputs, forced_tool
from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields
from mgserve.api.responses_messages import as_object, check_keys, input_messages, string_of

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True)
class ResponsesInput:
    """What a /v1/responses request gives the template, and what the response echoes."""

    chat: ChatInputs
    effort: str | None  # reasoning.effort as asked


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """A function tool (flat: name, description, parameters, strict) as a chat tool."""
    kind = as_object(tool, where, "tools").get("type")
    if kind != "function":
        raise ApiError(
            f"{where}: tool type {kind!r} is not supported (OpenAI's hosted tools run on its "
            "side); this server takes function tools: name, description, parameters",
            param="tools",
        )
    check_keys(tool, {"type", "name", "description", "parameters", "strict"}, where, "tools")
    fn: dict[str, Any] = {"name": string_of(tool, "name", where, "tools")}
    if tool.get("description") is not None:
        fn["description"] = string_of(tool, "description", where, "tools")
    if tool.get("parameters") is not None:
        fn["parameters"] = as_object(tool["parameters"], f"{where}.parameters", "tools")
    if not isinstance(tool.get("strict"), bool | None):
        raise ApiError(f"{where}.strict must be a boolean", param="tools")
    return {"type": "function", "function": fn}


def _tool_choice(raw: Any, tools: list[Any] | None) -> tuple[str, str | None]:
    """(the choice, the function it names): ``auto``, ``none``, ``required`` or
    ``{"type": "function", "name": ...}`` (forced calls, as on /v1/chat/completions)."""
    if raw is None or raw in ("auto", "none"):
        return raw or "auto", None
    if raw == "required":
        forced_tool(tools, None, "tool_choice")
        return "required", None
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name")
        if not isinstance(name, str):
            raise ApiError("tool_choice.name must be a string", param="tool_choice")
        forced_tool(tools, name, "tool_choice")
        return "required", name
    kind = raw.get("type") if isinstance(raw, dict) else raw
    raise ApiError(
        f"tool_choice {kind!r} is not supported (this server takes 'auto', 'none', 'required' "
        'or {"type": "function", "name": ...})',
        param="tool_choice",
    )


def _reasoning(raw: Any, switch: bool, thinks: bool) -> tuple[dict[str, Any], str | None]:
    """``reasoning`` -> the template's kwargs and the effort asked. ``switch``: the template reads
    ``enable_thinking``; ``thinks``: it has a reasoning block at all."""
    if raw is None:
        return {}, None
    obj = as_object(raw, "reasoning", "reasoning")
    check_keys(obj, {"effort", "summary", "generate_summary"}, "reasoning", "reasoning")
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
    opts = as_object(body.get("stream_options") or {}, "stream_options", "stream_options")
    check_keys(opts, {"include_obfuscation"}, "stream_options", "stream_options")
    if opts.get("include_obfuscation") not in (None, False):
        raise ApiError(
            "stream_options.include_obfuscation: only false is supported (stream events carry "
            "no obfuscation padding)",
            param="stream_options",
        )
    meta = as_object(body.get("metadata") or {}, "metadata", "metadata")
    if not all(isinstance(v, str) for v in meta.values()):
        raise ApiError("metadata values must be strings", param="metadata")
    text = as_object(body.get("text") or {}, "text", "text")  # its format: structured.py
    check_keys(text, {"format", "verbosity"}, "text", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError("text.verbosity: only 'medium' (the model's own) is supported", param="text")


def responses_input(body: dict[str, Any], switch: bool, thinks: bool) -> ResponsesInput:
    """/v1/responses: the template's inputs, checked. ``switch``: the chat template reads
    ``enable_thinking``; ``thinks``: it has a reasoning block."""
    _stateless(body)
    messages = input_messages(body.get("input"))
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
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError("'tools' must be a list", param="tools")
    if tools is not None:
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    chat = ChatInputs(messages, tools, kwargs, True, choice, name, parallel, None)
    return ResponsesInput(chat, effort)
