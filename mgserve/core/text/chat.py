"""Chat templates: OpenAI-style messages -> one prompt string.

The template is the GGUF's ``tokenizer.chat_template`` (untrusted code, run in the sandbox of
chat_env.py), a file or built-in name given with ``--chat-template``, or, for a file without one,
the built-in format of its family (chat_builtin.py). Messages are normalized first
(chat_messages.py: ``developer`` -> ``system``, text parts joined, tool-call arguments parsed).

A template is rendered with ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token``; ``tools`` only when the request has tools, so ``tools is defined`` means what
templates take it to mean; and the request's ``chat_template_kwargs`` (``enable_thinking``...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from mgserve.core.text.chat_builtin import BUILTIN, builtin_for
from mgserve.core.text.chat_env import TemplateError, chat_environment
from mgserve.core.text.chat_limits import render_budget
from mgserve.core.text.chat_messages import normalize_messages, normalize_tools, plain

__all__ = [
    "BUILTIN",
    "RESERVED",
    "ChatTemplate",
    "TemplateError",
    "load_chat_template",
    "normalize_messages",
]

# Names the server gives the template itself; chat_template_kwargs may not replace them.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})

# A conversation with one tool call, to learn whether a template reads tool-call arguments as an
# object or as the JSON string OpenAI clients send (llama.cpp's caps probe asks the same).
_PROBE_VALUE = "mgserve-probe-value"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool",
            "description": "A tool",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
]


def _probe_messages(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": "call00001", "type": "function"}
    call["function"] = {"name": "probe_tool", "arguments": arguments}  # type: ignore[assignment]
    return [
        {"role": "user", "content": "Use the tool."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "It is done."},
        {"role": "user", "content": "Thanks."},
    ]


def _shows_arguments(compiled: jinja2.Template, arguments: Any) -> bool:
    try:
        with render_budget():
            text = compiled.render(
                messages=_probe_messages(arguments),
                tools=_PROBE_TOOLS,
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
    except Exception:  # a template that refuses the probe (or runs out of budget) tells nothing
        return False
    return _PROBE_VALUE in text


def _reads_object_arguments(compiled: jinja2.Template) -> bool:
    """True unless the template renders string arguments and fails on (or drops) object ones."""
    if _shows_arguments(compiled, {"arg": _PROBE_VALUE}):
        return True
    return not _shows_arguments(compiled, '{"arg": "' + _PROBE_VALUE + '"}')


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token strings it is rendered with."""

    name: str  # "gguf", a built-in name, or the file it was read from
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        try:
            compiled = chat_environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template {self.name}: syntax error line {e.lineno}: {e}") from e
        object.__setattr__(self, "_compiled", compiled)
        # whether tool-call arguments are parsed to objects before rendering (almost always)
        object.__setattr__(self, "object_arguments", _reads_object_arguments(compiled))

    def apply(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        tools: Any = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render messages to a prompt. A leading BOS is dropped: the tokenizer adds its own.

        Raises ValueError (TemplateError) for bad messages or a template that refuses them.
        """
        context: dict[str, Any] = {}
        for key, value in (kwargs or {}).items():
            if key in RESERVED:
                raise ValueError(f"chat_template_kwargs may not set {key!r}")
            context[key] = plain(value, f"chat_template_kwargs.{key}")
        context.update(
            messages=normalize_messages(messages, self.object_arguments),  # type: ignore[attr-defined]
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        tool_list = normalize_tools(tools)
        if tool_list is not None:
            context["tools"] = tool_list
        try:
            with render_budget():  # time and text bounds (chat_limits.py)
                text: str = self._compiled.render(context)  # type: ignore[attr-defined]
        except TemplateError:
            raise
        except jinja2.UndefinedError as e:  # say how a template's own variables can be given
            raise TemplateError(
                f"chat template error: {e} (a request can set the template's variables in "
                "chat_template_kwargs)"
            ) from e
        except Exception as e:  # the template is untrusted code: any failure is the request's
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def load_chat_template(
    override: str | None,
    gguf_template: str | None,
    architecture: str,
    bos_token: str = "",
    eos_token: str = "",
    has_token: Callable[[str], bool] | None = None,
) -> ChatTemplate:
    """Pick the template: --chat-template (built-in name or file), else the GGUF's, else the
    built-in format of the architecture (checked against the vocabulary with ``has_token``)."""
    if override:
        if override in BUILTIN:
            return ChatTemplate(override, BUILTIN[override], bos_token, eos_token)
        path = Path(override)
        if not path.is_file():
            raise ValueError(
                f"--chat-template {override!r} is neither a built-in name "
                f"({', '.join(BUILTIN)}) nor a readable file"
            )
        return ChatTemplate(str(path), path.read_text(encoding="utf-8"), bos_token, eos_token)
    if gguf_template:
        return ChatTemplate("gguf", gguf_template, bos_token, eos_token)
    name = builtin_for(architecture, has_token)
    return ChatTemplate(name, BUILTIN[name], bos_token, eos_token)
