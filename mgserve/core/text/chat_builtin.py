"""Built-in chat formats, for GGUF files that carry no ``tokenizer.chat_template``.

Each renders a conversation exactly as its model family's own template does (system prompt rules,
tool descriptions, tool calls, tool replies, thinking blocks); tests/core/test_chat_builtin.py
checks them against the real templates (tests/data/templates/) on the same conversations. They
are written here (the Qwen family's in chat_qwen.py) from the formats' descriptions; the fixed
instruction texts are the families' own words, since the models were trained on exactly those.

- ``gemma``: Gemma 2/3 turns (``<start_of_turn>user|model``); system text folded into the first user
  turn (Gemma 3; Gemma 2 refuses a system message), user/model strictly alternating.
- ``chatml``: plain ChatML, for families not listed here.
- ``qwen2.5``: ChatML with Qwen 2.5's default system prompt and JSON tool calls.
- ``qwen3``: Qwen 3's: ``<think>`` blocks after the last user query, ``enable_thinking=false``.
- ``qwen3.5``: Qwen 3.5's: XML-style tool calls (``<function=..><parameter=..>``), thinking opened.
- ``llama3``: Llama 3.1/3.3's header turns with the knowledge-date system block and JSON tool calls.
"""

from __future__ import annotations

from collections.abc import Callable

from mgserve.core.text.chat_qwen import QWEN3, QWEN25, QWEN35

GEMMA = """{{- bos_token -}}
{%- set ns = namespace(prefix='', turns=messages) -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.prefix = messages[0].content + '\n\n' -%}
    {%- set ns.turns = messages[1:] -%}
{%- endif -%}
{%- for m in ns.turns -%}
    {%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Conversation roles must alternate '
            'user/assistant/user/assistant/...') -}}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if m.role == 'assistant' else m.role) ~ '\n' -}}
    {{- (ns.prefix if loop.first else '') ~ (m.content | trim) ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""

CHATML = """{%- for m in messages -%}
    {{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

LLAMA3 = """{{- bos_token -}}
{%- set date = date_string if date_string is defined else '26 Jul 2024' -%}
{%- set in_user = tools_in_user_message if tools_in_user_message is defined else true -%}
{%- set has_tools = tools is defined and tools is not none -%}
{%- set ns = namespace(turns=messages, system='') -%}
{%- if messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content | trim -%}
    {%- set ns.turns = messages[1:] -%}
{%- endif -%}
{%- macro tool_list() -%}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument '
        'name and its value}.Do not use variables.\n\n' -}}
    {%- for t in tools -%}{{- (t | tojson(indent=4)) ~ '\n\n' -}}{%- endfor -%}
{%- endmacro -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{{- 'Environment: ipython\n' if has_tools else '' -}}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' ~ date ~ '\n\n' -}}
{%- if has_tools and not in_user -%}
    {{- 'You have access to the following functions. To call a function, please respond with '
        'JSON for a function call.' ~ tool_list() -}}
{%- endif -%}
{{- ns.system ~ '<|eot_id|>' -}}
{%- if has_tools and in_user -%}
    {%- if not ns.turns -%}
        {{- raise_exception("Cannot put tools in the first user message when there's no first "
            "user message!") -}}
    {%- endif -%}
    {{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please '
        'respond with a JSON for a function call with its proper arguments that best answers '
        'the given prompt.\n\n' ~ tool_list() ~ (ns.turns[0].content | trim) ~ '<|eot_id|>' -}}
    {%- set ns.turns = ns.turns[1:] -%}
{%- endif -%}
{%- for m in ns.turns -%}
    {%- if m.role in ('tool', 'ipython') -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' ~ (m.content | tojson) -}}
    {%- elif m.tool_calls is defined -%}
        {%- if m.tool_calls | length != 1 -%}
            {{- raise_exception('This model only supports single tool-calls at once!') -}}
        {%- endif -%}
        {%- set f = m.tool_calls[0].function -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' ~ f.name -}}
        {{- '", "parameters": ' ~ (f.arguments | tojson) ~ '}' -}}
    {%- else -%}
        {{- '<|start_header_id|>' ~ m.role ~ '<|end_header_id|>\n\n' ~ (m.content | trim) -}}
    {%- endif -%}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}"""

BUILTIN = {
    "gemma": GEMMA,
    "chatml": CHATML,
    "qwen2.5": QWEN25,
    "qwen3": QWEN3,
    "qwen3.5": QWEN35,
    "llama3": LLAMA3,
}

# The format each served architecture's chat models use when their file carries no template.
ARCH_FORMAT = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "qwen2": "qwen2.5",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3",
    "qwen3next": "qwen3",
    "qwen4exp": "qwen3.5",
    "llama": "llama3",
}

# The special token each format's turns are built from: a vocabulary without it was not trained on
# that format (a `llama` file may be SmolLM's ChatML, say), so the choice falls to one it has.
MARKER = {"gemma": "<start_of_turn>", "llama3": "<|start_header_id|>"}
_CHATML_MARKER = "<|im_start|>"


def builtin_for(architecture: str, has_token: Callable[[str], bool] | None = None) -> str:
    """The built-in format for a file without a template: by architecture, checked against the
    vocabulary's turn markers when ``has_token`` is given."""
    name = ARCH_FORMAT.get(architecture, "chatml")
    if has_token is None or has_token(MARKER.get(name, _CHATML_MARKER)):
        return name
    for other, marker in MARKER.items():
        if has_token(marker):
            return other
    return "chatml" if has_token(_CHATML_MARKER) else name
