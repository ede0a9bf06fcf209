"""A chat request's template inputs (messages, tools, chat_template_kwargs...), checked.

The messages themselves are checked when the template renders them
(core/text/chat_messages.py), on the text pool; here is what is cheap to check on the loop.
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


def chat_inputs(body: dict[str, Any]) -> ChatInputs:
    """/v1/chat/completions and /apply-template: the template's inputs, checked."""
    f = Fields(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError("'tools' must be a list", param="tools")
    if body.get("tool_choice") not in (None, "auto"):
        raise ApiError(
            f"tool_choice {body['tool_choice']!r} is not supported (only 'auto': the model "
            "decides whether to call a tool)",
            param="tool_choice",
        )
    if f.get_bool("parallel_tool_calls", True) is False:
        raise ApiError("parallel_tool_calls=false is not supported", param="parallel_tool_calls")
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
    )
