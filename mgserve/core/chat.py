"""Chat templates: OpenAI-style messages -> one prompt string, rendered in a sandboxed jinja2.

A GGUF's ``tokenizer.chat_template`` is untrusted code, so it runs in jinja2's immutable sandbox
with the globals Hugging Face templates expect (``raise_exception``, ``strftime_now``, ``bos_token``
...), and ``trim_blocks``/``lstrip_blocks`` as transformers sets them. Files without a template get
a built-in format chosen by architecture; ``--chat-template`` overrides with a name or a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")

GEMMA = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'assistant') != (loop.index0 % 2 == 1) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""

CHATML = """{%- for message in messages -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}"""

LLAMA3 = """{{ bos_token }}
{%- for message in messages -%}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif -%}"""

BUILTIN = {"gemma": GEMMA, "chatml": CHATML, "llama3": LLAMA3}

# Architectures whose files sometimes come without a template, and the format they were trained on.
ARCH_FORMAT = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "qwen3moe": "chatml",
    "qwen3next": "chatml",
    "qwen4exp": "chatml",
    "llama": "llama3",
}


class TemplateError(ValueError):
    """The template rejected the conversation (its own raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # transformers' override: keep non-ASCII as is, which jinja's own tojson escapes
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content: a text part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate roles and flatten content-part lists to strings; ValueError on anything else."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), i)
        out.append(msg)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token strings it is rendered with."""

    name: str  # "gguf", a built-in name, or the file it was read from
    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template {self.name}: syntax error line {e.lineno}: {e}") from e
        object.__setattr__(self, "_compiled", compiled)

    def apply(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **extra: Any,
    ) -> str:
        """Render messages to a prompt. A leading BOS is dropped: the tokenizer adds its own.

        Raises ValueError (TemplateError) for bad messages or a template that refuses them.
        """
        msgs = normalize_messages(messages)
        try:
            text = self._compiled.render(  # type: ignore[attr-defined]
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                tools=tools,
                **extra,
            )
        except TemplateError:
            raise
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
) -> ChatTemplate:
    """Pick the template: --chat-template (built-in name or file), else the GGUF's, else by arch."""
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
    name = ARCH_FORMAT.get(architecture, "chatml")
    return ChatTemplate(name, BUILTIN[name], bos_token, eos_token)
