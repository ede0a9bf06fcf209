"""What real templates rely on: normalized messages, the variables they get, filters and tags."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from mgserve.core.text.chat import ChatTemplate, TemplateError
from mgserve.core.text.chat_messages import normalize_messages

USER = [{"role": "user", "content": "hi"}]


def call(arguments: object) -> dict[str, object]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}


def render(src: str, messages: object = USER, **kw: object) -> str:
    return ChatTemplate("t", src).apply(messages, **kw)  # type: ignore[arg-type]


def test_developer_takes_the_place_of_system() -> None:
    msgs = normalize_messages([{"role": "developer", "content": "rules"}, *USER])
    assert msgs[0] == {"role": "system", "content": "rules"}


def test_text_parts_are_joined_with_newlines_as_llama_cpp_does() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "one\ntwo"


def test_tool_call_arguments_are_parsed_and_invalid_json_is_kept() -> None:
    msgs = normalize_messages(
        [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call('{"city": "Paris"}'), call("not json"), call("[1, 2]")],
            },
        ]
    )
    args = [c["function"]["arguments"] for c in msgs[1]["tool_calls"]]
    assert args == [{"city": "Paris"}, "not json", "[1, 2]"]
    assert msgs[1]["content"] == ""  # templates concatenate it


def test_a_template_written_for_string_arguments_gets_strings() -> None:
    src = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ '>>>' + c.function.name + '\\n' + c.function.arguments }}{% endfor %}{% endfor %}"
    )
    t = ChatTemplate("strings", src)
    assert not t.object_arguments  # found by rendering a probe conversation once
    conv = [*USER, {"role": "assistant", "content": "", "tool_calls": [call('{"a": 1}')]}]
    assert t.apply(conv) == '>>>f\n{"a": 1}'
    assert ChatTemplate("objects", "{{ messages | tojson }}").object_arguments


def test_tools_are_undefined_unless_given() -> None:
    src = "{{ 'defined' if tools is defined else 'undefined' }}"
    assert render(src) == "undefined"
    assert render(src, tools=[]) == "undefined"  # an empty list is no tools
    assert render(src, tools=[{"type": "function", "function": {"name": "f"}}]) == "defined"
    with pytest.raises(ValueError, match="'tools' must be a list of objects"):
        render(src, tools=["f"])


def test_chat_template_kwargs_reach_the_template() -> None:
    src = "{{ 'think' if enable_thinking is not defined or enable_thinking else 'no-think' }}"
    assert render(src) == "think"
    assert render(src, kwargs={"enable_thinking": False}) == "no-think"
    with pytest.raises(ValueError, match="may not set 'messages'"):
        render(src, kwargs={"messages": []})


def test_undefined_variable_error_points_at_chat_template_kwargs() -> None:
    with pytest.raises(TemplateError, match="'functions' is undefined.*chat_template_kwargs"):
        render("{{ 'x' + functions }}")
    assert render("{{ 'x' + functions }}", kwargs={"functions": "[]"}) == "x[]"


def test_tojson_options() -> None:
    data = {"b": "é", "a": [1, 2]}
    kw = {"kwargs": {"d": data}}
    assert render("{{ d | tojson }}", **kw) == json.dumps(data, ensure_ascii=False)
    assert render("{{ d | tojson(ensure_ascii=True) }}", **kw) == json.dumps(data)
    assert render("{{ d | tojson(indent=2) }}", **kw) == json.dumps(
        data, indent=2, ensure_ascii=False
    )
    assert render("{{ d | tojson(separators=(',', ':'), sort_keys=true) }}", **kw) == (
        '{"a":[1,2],"b":"é"}'
    )
    # a generator from map() serializes as a list, as in llama.cpp's engine
    assert render("{{ d.a | map('string') | tojson }}", **kw) == '["1", "2"]'


def test_from_json_generation_tag_strftime_now_namespace() -> None:
    assert render("{{ ('{\"a\": [1]}' | from_json).a[0] + 1 }}") == "2"
    src = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert render(src) == "<hi>"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    src = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    )
    assert render(src + "{{ ns.n }}") == "1"
    with pytest.raises(TemplateError, match="namespace attribute"):
        render("{% set ns = namespace(_hidden=1) %}")


def test_raise_exception_keeps_the_templates_own_message() -> None:
    with pytest.raises(TemplateError) as e:
        render("{{ raise_exception('Only user and assistant roles are supported!') }}")
    assert str(e.value) == "Only user and assistant roles are supported!"
