"""Built-in chat formats, for GGUF files that carry no ``tokenizer.chat_template``.

Each renders a conversation exactly as its model family's own template does (system prompt rules,
tool descriptions, tool calls, tool replies, thinking blocks); tests/core/test_chat_builtin.py
checks them against the real templates (tests/data/templates/) on the same conversations. They
are written here from the formats' descriptions; the fixed instruction texts are the families'
own words, since the models were trained on exactly those.

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

# Qwen's instructions for JSON tool calls (2.5 and 3 share them)
_QWEN_TOOLS = """\
{%- macro tool_list() -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for t in tools -%}{{- '\n' ~ (t | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' -}}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endmacro -%}
"""

# consecutive tool replies share one user turn, each in <tool_response> tags
_QWEN_TOOL_REPLY = """\
{%- macro tool_reply(m, prev, next, text) -%}
    {%- if prev is none or prev.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' ~ text ~ '\n</tool_response>' -}}
    {%- if next is none or next.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endmacro -%}
"""

QWEN25 = (
    _QWEN_TOOLS
    + _QWEN_TOOL_REPLY
    + """\
{%- set has_system = messages[0].role == 'system' -%}
{%- set system = messages[0].content if has_system
    else 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}
{{- '<|im_start|>system\n' ~ system -}}
{%- if tools -%}{{- '\n\n' ~ tool_list() -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for m in messages -%}
    {%- set prev = loop.previtem if not loop.first else none -%}
    {%- set next = loop.nextitem if not loop.last else none -%}
    {%- if m.role == 'tool' -%}
        {{- tool_reply(m, prev, next, m.content) -}}
    {%- elif m.role == 'assistant' and m.tool_calls -%}
        {{- '<|im_start|>assistant' ~ ('\n' ~ m.content if m.content else '') -}}
        {%- for c in m.tool_calls -%}
            {%- set f = c.function if c.function is defined else c -%}
            {{- '\n<tool_call>\n{"name": "' ~ f.name ~ '", "arguments": ' -}}
            {{- (f.arguments | tojson) ~ '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif not (loop.first and has_system) -%}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""
)

# Qwen 3 and 3.5 show the reasoning only of assistant turns after the last real user query
# (a user turn that is not just wrapped tool output)
_LAST_QUERY = """\
{%- set q = namespace(index=none) -%}
{%- for m in messages -%}
    {%- set text = m.content | trim if trim_query else m.content -%}
    {%- if m.role == 'user'
        and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
        {%- set q.index = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
"""

# an assistant turn's reasoning and answer, into ``out``: its reasoning_content (Qwen 3: any
# non-null value; 3.5: a string), else a <think> block at the head of the content
_SPLIT_THINK = """\
{%- macro split_think(m, content, out, any_reasoning) -%}
    {%- set given = m.reasoning_content is defined and m.reasoning_content is not none -%}
    {%- if given and (any_reasoning or m.reasoning_content is string) -%}
        {%- set out.think = m.reasoning_content -%}
        {%- set out.answer = content -%}
    {%- elif '</think>' in content -%}
        {%- set out.think = content.split('</think>')[0].rstrip('\n').split('<think>')[-1] -%}
        {%- set out.think = out.think.lstrip('\n') -%}
        {%- set out.answer = content.split('</think>')[-1].lstrip('\n') -%}
    {%- else -%}
        {%- set out.answer = content -%}
    {%- endif -%}
{%- endmacro -%}
"""

QWEN3 = (
    _QWEN_TOOLS
    + _QWEN_TOOL_REPLY
    + _SPLIT_THINK
    + "{%- set trim_query = false -%}"
    + _LAST_QUERY
    + """\
{%- set last_query = messages | length - 1 if q.index is none else q.index -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' ~ (messages[0].content ~ '\n\n' if has_system else '') -}}
    {{- tool_list() ~ '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set prev = loop.previtem if not loop.first else none -%}
    {%- set next = loop.nextitem if not loop.last else none -%}
    {%- if m.role == 'tool' -%}
        {{- tool_reply(m, prev, next, m.content) -}}
    {%- elif m.role == 'assistant' -%}
        {%- set t = namespace(think='', answer='') -%}
        {{- split_think(m, m.content, t, true) -}}
        {%- set think, answer = t.think, t.answer -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > last_query and (loop.last or think) -%}
            {{- '<think>\n' ~ think.strip('\n') ~ '\n</think>\n\n' ~ answer.lstrip('\n') -}}
        {%- else -%}
            {{- answer -}}
        {%- endif -%}
        {%- for c in m.tool_calls or [] -%}
            {%- set f = c.function if c.function else c -%}
            {%- if not loop.first or answer -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' ~ f.name ~ '", "arguments": ' -}}
            {{- (f.arguments if f.arguments is string else f.arguments | tojson) -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif not (loop.first and has_system) -%}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}"""
)

QWEN35 = (
    _QWEN_TOOL_REPLY
    + _SPLIT_THINK
    + "{%- set trim_query = true -%}"
    + _LAST_QUERY
    + """\
{%- if q.index is none -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}
{%- set system = messages[0].content | trim if messages[0].role == 'system' else '' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for t in tools -%}{{- '\n' ~ (t | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with '
        'NO suffix:\n\n<tool_call>\n<function=example_function_name>\n'
        '<parameter=example_parameter_1>\nvalue_1\n</parameter>\n'
        '<parameter=example_parameter_2>\nThis is the value for the second parameter\n'
        'that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n'
        '<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner '
        '<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n'
        '- Required parameters MUST be specified\n- You may provide optional reasoning for your '
        'function call in natural language BEFORE the function call, but NOT after\n- If there is '
        'no function call available, answer the question like normal with your current knowledge '
        'and do not tell the user about function calls\n</IMPORTANT>' -}}
    {{- ('\n\n' ~ system if system else '') ~ '<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' ~ system ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set content = m.content | trim -%}
    {%- if m.role == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('System message must be at the beginning.') -}}
        {%- endif -%}
    {%- elif m.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set t = namespace(think='', answer='') -%}
        {{- split_think(m, content, t, false) -}}
        {%- set think, answer = t.think | trim, t.answer -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > q.index -%}
            {{- '<think>\n' ~ think ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- answer -}}
        {%- for c in m.tool_calls or [] -%}
            {%- set f = c.function if c.function is defined else c -%}
            {%- if not loop.first -%}{{- '\n' -}}
            {%- elif answer | trim -%}{{- '\n\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n<function=' ~ f.name ~ '>\n' -}}
            {%- if f.arguments is defined -%}
                {%- for name, value in f.arguments | items -%}
                    {%- set structured = value is mapping
                        or (value is sequence and value is not string) -%}
                    {{- '<parameter=' ~ name ~ '>\n' -}}
                    {{- (value | tojson if structured else value | string) ~ '\n</parameter>\n' -}}
                {%- endfor -%}
            {%- endif -%}
            {{- '</function>\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if not loop.first and loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role.') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {{- '<think>\n\n</think>\n\n' if enable_thinking is defined and enable_thinking is false
        else '<think>\n' -}}
{%- endif -%}"""
)

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
