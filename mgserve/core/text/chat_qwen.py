"""The Qwen family's built-in chat formats (chat_builtin.py lists them with the others).

- ``qwen2.5``: ChatML with Qwen 2.5's default system prompt and JSON tool calls;
- ``qwen3``: Qwen 3's: ``<think>`` blocks after the last user query, ``enable_thinking=false``;
- ``qwen3.5``: Qwen 3.5's: XML-style tool calls (``<function=..><parameter=..>``), thinking opened.

2.5 and 3 share the tool instructions and the turn loop (``_TURNS``), each giving the body of its
assistant turns as the macro ``assistant_turn``; 3 and 3.5 share how reasoning is found and shown.
"""

from __future__ import annotations

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

# The turns of 2.5 and 3: consecutive tool replies share one user turn, each in
# <tool_response> tags; an assistant turn's body is the template's ``assistant_turn`` macro.
_TURNS = """\
{%- for m in messages -%}
    {%- if m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' ~ m.content ~ '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_start|>assistant' ~ assistant_turn(m, loop) ~ '<|im_end|>\n' -}}
    {%- elif not (loop.first and has_system) -%}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
"""

QWEN25 = (
    _QWEN_TOOLS
    + """\
{%- macro assistant_turn(m, turn) -%}
    {%- if m.tool_calls -%}
        {{- ('\n' ~ m.content if m.content else '') -}}
        {%- for c in m.tool_calls -%}
            {%- set f = c.function if c.function is defined else c -%}
            {{- '\n<tool_call>\n{"name": "' ~ f.name ~ '", "arguments": ' -}}
            {{- (f.arguments | tojson) ~ '}\n</tool_call>' -}}
        {%- endfor -%}
    {%- else -%}
        {{- '\n' ~ m.content -}}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- set system = messages[0].content if has_system
    else 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}
{{- '<|im_start|>system\n' ~ system -}}
{%- if tools -%}{{- '\n\n' ~ tool_list() -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
"""
    + _TURNS
    + """{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""
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
    + _SPLIT_THINK
    + "{%- set trim_query = false -%}"
    + _LAST_QUERY
    + """\
{%- macro assistant_turn(m, turn) -%}
    {%- set t = namespace(think='', answer='') -%}
    {{- split_think(m, m.content, t, true) -}}
    {%- set think, answer = t.think, t.answer -%}
    {{- '\n' -}}
    {%- if turn.index0 > last_query and (turn.last or think) -%}
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
{%- endmacro -%}
{%- set last_query = messages | length - 1 if q.index is none else q.index -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' ~ (messages[0].content ~ '\n\n' if has_system else '') -}}
    {{- tool_list() ~ '<|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' -}}
{%- endif -%}
"""
    + _TURNS
    + """\
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}"""
)

QWEN35 = (
    _SPLIT_THINK
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
