"""A chat request's template inputs (messages, tools, chat_template_kwargs...), checked.

The messages themselves are checked when the template renders them
(core/text/chat_messages.py), on the text pool; here is what is cheap to check on the loop.

``tool_choice``: ``auto`` (the default) renders the tools and reads the model's calls; ``none``
renders them too but reads no call, so the answer is text (as llama-server does: the tools stay
in the prompt, the parser is off). ``required`` and a named function force a call, which needs
constrained decoding: refused with a 400 until the grammar engine is wired in.
``parallel_tool_calls: false`` keeps the first call the model writes and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields
from mgserve.core.text.chat import RESERVED


@dataclass(frozen=True)
class ChatInputs:
    """What a chat request gives the template (messages are checked when it renders them)."""

    messages: Any
    tools: list[Any] | None
    kwargs: dict[str, Any]  # chat_template_kwargs, e.g. {"enable_thinking": false}
    add_generation_prompt: bool
    tool_choice: str  # "auto" or "none"
    parallel_tool_calls: bool  # False: only the first call is returned
    reasoning_format: str | None  # the request's ("none", "deepseek", "auto"); None: the server's


# llama-server's names; deepseek-legacy (tags kept in the content as well) is not implemented
REASONING_FORMATS = ("none", "deepseek", "auto")


def _tool_choice(body: dict[str, Any]) -> str:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if choice == "required" or named:
        what = "'required'" if choice == "required" else "a named function"
        raise ApiError(
            f"tool_choice {what} is not supported yet: forcing a tool call needs constrained "
            "decoding, which this server does not have yet; use 'auto' or 'none'",
            param="tool_choice",
        )
    raise ApiError(
        "tool_choice must be 'auto', 'none', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _tools(body: dict[str, Any]) -> list[Any] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError("'tools' must be a list", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ApiError(
                f'\'tools\' must be a list of objects {{"type": "function", "function": '
                f"{{...}}}}; tools[{i}] is not one",
                param="tools",
            )
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(f"tools[{i}].function.name must be a non-empty string", param="tools")
    return tools


def chat_inputs(body: dict[str, Any]) -> ChatInputs:
    """/v1/chat/completions and /apply-template: the template's inputs, checked."""
    f = Fields(body)
    tools = _tools(body)
    tool_choice = _tool_choice(body)
    reasoning = body.get("reasoning_format")
    if reasoning is not None and reasoning not in REASONING_FORMATS:
        raise ApiError(
            f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning!r}",
            param="reasoning_format",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if kwargs.keys() & RESERVED:
        raise ApiError(
            f"chat_template_kwargs may not set {sorted(kwargs.keys() & RESERVED)[0]!r} "
            "(the request has its own field for it)",
            param="chat_template_kwargs",
        )
    if not isinstance(kwargs.get("enable_thinking", False), bool):
        raise ApiError(
            "chat_template_kwargs.enable_thinking must be a boolean", param="chat_template_kwargs"
        )
    return ChatInputs(
        messages=body.get("messages"),
        tools=tools,
        kwargs=kwargs,
        add_generation_prompt=f.get_bool("add_generation_prompt", True),
        tool_choice=tool_choice,
        parallel_tool_calls=f.get_bool("parallel_tool_calls", True),
        reasoning_format=reasoning,
    )
