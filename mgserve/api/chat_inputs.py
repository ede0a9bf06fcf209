"""A chat request's template inputs (messages, tools, chat_template_kwargs...), checked.

The messages themselves are checked when the template renders them
(core/text/chat_messages.py), on the text pool; here is what is cheap to check on the loop.

``tool_choice``: ``auto`` (the default) renders the tools and reads the model's calls; ``none``
renders them too but reads no call, so the answer is text (as llama-server does: the tools stay
in the prompt, the parser is off). ``required`` and a named function force calls by constrained
decoding (api/tool_grammar.py): any of the tools, or only the named one.
``parallel_tool_calls: false`` keeps the first call the model writes and drops the rest (forced:
the grammar allows exactly one).
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
    tool_choice: str  # "auto", "none" or "required" (a call is forced)
    tool_name: str | None  # tool_choice named this function: only it may be called
    parallel_tool_calls: bool  # False: only the first call is returned
    reasoning_format: str | None  # the request's ("none", "deepseek", "auto"); None: the server's


# llama-server's names; deepseek-legacy (tags kept in the content as well) is not implemented
REASONING_FORMATS = ("none", "deepseek", "auto")


def forced_tool(tools: list[Any] | None, name: str | None, param: str) -> None:
    """A forced call needs tools to call, and a named one must be among them."""
    if not tools:
        raise ApiError(f"{param} forces a tool call, but the request has no 'tools'", param=param)
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise ApiError(f"{param} names {name!r}, which is not one of the 'tools'", param=param)


def _tool_choice(body: dict[str, Any], tools: list[Any] | None) -> tuple[str, str | None]:
    """(the choice, the function it names)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if choice == "required" or named:
        name = None
        if named:
            fn = choice.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(
                    "tool_choice.function must be an object with a 'name' string",
                    param="tool_choice",
                )
            name = fn["name"]
        forced_tool(tools, name, "tool_choice")
        return "required", name
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
    tool_choice, tool_name = _tool_choice(body, tools)
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
        tool_name=tool_name,
        parallel_tool_calls=f.get_bool("parallel_tool_calls", True),
        reasoning_format=reasoning,
    )
