"""The chat-output parser's edge cases: malformed calls stay text, reasoning with and without its
opening tag, markers split anywhere, held text flushed at the end, one call when not parallel."""

from __future__ import annotations

from typing import Any

import pytest

from mgserve.api.chat_output import ChatFormat, ChatOutputParser
from tests.api.test_chat_output import TOOLS, joined, parse

XML = ChatFormat("xml", ("<think>", "</think>"))
HERMES = ChatFormat("hermes", ("<think>", "</think>"))
LLAMA3 = ChatFormat("llama3", None)
MISTRAL = ChatFormat("mistral", None)
STEPS = [1, 2, 5, 10_000]


def read(fmt: ChatFormat, text: str, step: int, **kw: Any) -> tuple[str, str, list[Any]]:
    kw = {"tools_enabled": True, "tools": TOOLS} | kw
    return joined(parse(ChatOutputParser(fmt, **kw), text, step))


MALFORMED = [
    (XML, "<tool_call>\n<function=unknown_tool>\n</function>\n</tool_call>"),
    (XML, "<tool_call>\nnot xml at all\n</tool_call>"),
    (XML, "Use <tool_call> tags like <tool_call>this"),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    (HERMES, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> after'),
    (LLAMA3, '{"answer": 42}'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"'),
    (MISTRAL, "[TOOL_CALLS]get weather[ARGS]{}"),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"'),
    (MISTRAL, "[TOOL_CALLS]not a list"),
]


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
@pytest.mark.parametrize("step", STEPS)
def test_a_malformed_call_is_content(fmt: ChatFormat, text: str, step: int) -> None:
    assert read(fmt, text, step) == ("", text, [])


@pytest.mark.parametrize("step", STEPS)
def test_a_good_call_after_a_malformed_one(step: int) -> None:
    bad = '<tool_call>\n{"name": "nope"}\n</tool_call>'
    good = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    assert read(HERMES, bad + "\n" + good, step) == ("", bad, [("search", {"query": "x"})])


@pytest.mark.parametrize("step", STEPS)
def test_reasoning_with_and_without_the_opening_tag(step: int) -> None:
    text = "<think>\nLet me see.\nYes.\n</think>\n\nThe answer."
    want = ("Let me see.\nYes.", "The answer.", [])
    assert read(HERMES, text, step, tools_enabled=False) == want
    opened = text.removeprefix("<think>")  # the prompt opened the block (Qwen 3.5)
    assert read(XML, opened, step, think_open=True) == want
    # reasoning format none: all of it is content, tags included
    assert read(HERMES, text, step, reasoning=False) == ("", text, [])
    assert read(XML, opened, step, reasoning=False, think_open=True) == ("", opened, [])


@pytest.mark.parametrize("step", STEPS)
def test_reasoning_cut_off_and_calls_inside_it(step: int) -> None:
    call = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    assert read(HERMES, f"<think>\nmaybe {call}", step) == (f"maybe {call}", "", [])
    assert read(XML, "still thinking\n\n", step, think_open=True) == ("still thinking", "", [])
    assert read(HERMES, "No <think> here", step) == ("", "No <think> here", [])


@pytest.mark.parametrize("step", STEPS)
def test_partial_markers_are_held_then_flushed(step: int) -> None:
    assert read(HERMES, "Hello <tool_ca", step) == ("", "Hello <tool_ca", [])
    assert read(HERMES, "  <thi", step) == ("", "  <thi", [])
    assert read(MISTRAL, "text [TOOL_", step) == ("", "text [TOOL_", [])
    assert read(XML, "a\n\n", step) == ("", "a\n\n", [])


def test_held_text_is_not_emitted_early() -> None:
    p = ChatOutputParser(HERMES, tools_enabled=True, tools=TOOLS)
    assert joined(p.feed("Sure. <tool_"))[1] == "Sure."
    assert joined(p.feed("x> done"))[1] == " <tool_x> done"


@pytest.mark.parametrize("step", STEPS)
def test_without_tools_calls_are_text(step: int) -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    assert read(HERMES, text, step, tools_enabled=False) == ("", text, [])


@pytest.mark.parametrize("step", STEPS)
def test_a_cut_off_xml_call_is_closed(step: int) -> None:
    text = "<tool_call>\n<function=search>\n<parameter=query>\nweather in Par"
    assert read(XML, text, step) == ("", "", [("search", {"query": "weather in Par"})])


@pytest.mark.parametrize("step", STEPS)
def test_xml_after_a_broken_parameter_list_is_content(step: int) -> None:
    text = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\noops"
    assert read(XML, text, step) == ("", "oops", [("search", {"query": "x"})])


@pytest.mark.parametrize("step", STEPS)
def test_xml_values_typed_by_schema(step: int) -> None:
    params = {"city": "42", "days": "x", "hourly": "false", "extra": "[1, 2]"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text = f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"
    want = {"city": "42", "days": "x", "hourly": False, "extra": [1, 2]}
    assert read(XML, text, step)[2] == [("get_weather", want)]


@pytest.mark.parametrize("step", STEPS)
def test_not_parallel_keeps_the_first_call(step: int) -> None:
    one = '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>\n'
    two = '<tool_call>\n{"name": "search", "arguments": {"query": "b"}}\n</tool_call>'
    assert read(HERMES, one + two, step, parallel=False)[2] == [("search", {"query": "a"})]


@pytest.mark.parametrize("step", STEPS)
def test_content_before_a_call(step: int) -> None:
    text = 'Checking.\n\n<|python_tag|>{"name": "search", "parameters": {"query": "q"}}'
    assert read(LLAMA3, text, step) == ("", "Checking.", [("search", {"query": "q"})])
