"""The built-in formats (files without a template) render as their families' real templates do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mgserve.core.text.chat import BUILTIN, ChatTemplate, load_chat_template

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City"},
                    "days": {"type": "array", "description": "Days ahead"},
                },
                "required": ["city"],
            },
        },
    }
]


def call(i: int, args: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": "get_weather", "arguments": json.dumps(args)}
    return {"id": f"call{i}", "type": "function", "function": fn}


SYSTEM = {"role": "system", "content": "  Be brief.  "}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "plain": [
        SYSTEM,
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Name three colours."},
    ],
    "no-system": [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": " Hi there \n"},
        {"role": "user", "content": "Bye"},
    ],
    "one-turn": [{"role": "user", "content": "Hello!"}],
    "thinking": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "r2"},
    ],
    "tool": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call(1, {"city": "Paris", "days": [1]})],
        },
        {"role": "tool", "tool_call_id": "call1", "content": "18 C, sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And Rome?"},
    ],
    "two-calls": [
        SYSTEM,
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [call(1, {"city": "Paris"}), call(2, {"city": "Rome", "n": 3})],
        },
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call2", "content": "rain"},
    ],
    "call-after-thinking": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "<think>let me call</think>",
            "tool_calls": [call(1, {"city": "Paris"})],
        },
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
    ],
}
KWARGS: list[dict[str, Any]] = [{}, {"enable_thinking": False}, {"date_string": "01 Jan 2026"}]

# (built-in, real template, conversations where both render or both refuse the same way)
PAIRS = [
    ("qwen2.5", "Qwen-Qwen2.5-7B-Instruct", list(CONVERSATIONS)),
    ("qwen3", "Qwen-Qwen3-0.6B", list(CONVERSATIONS)),
    ("qwen3.5", "Qwen3.5-4B", list(CONVERSATIONS)),
    ("llama3", "meta-llama-Llama-3.1-8B-Instruct", list(CONVERSATIONS)),
    ("llama3", "meta-llama-Llama-3.3-70B-Instruct", list(CONVERSATIONS)),
    # Gemma 2 refuses a system turn, which Gemma 3 (the built-in) folds into the first user turn
    ("gemma", "google-gemma-2-2b-it", [c for c in CONVERSATIONS if CONVERSATIONS[c][0] != SYSTEM]),
]


def outcome(t: ChatTemplate, messages: list[dict[str, Any]], tools: Any, kw: dict[str, Any]) -> str:
    try:
        return t.apply(messages, tools=tools, kwargs=kw)
    except ValueError as e:
        return f"refused: {e}"


@pytest.mark.parametrize(("builtin", "real", "convs"), PAIRS, ids=[p[1] for p in PAIRS])
def test_builtin_matches_the_real_template(builtin: str, real: str, convs: list[str]) -> None:
    ours = ChatTemplate(builtin, BUILTIN[builtin], "<s>", "</s>")
    theirs = ChatTemplate(real, (TEMPLATES / f"{real}.jinja").read_text(), "<s>", "</s>")
    n_rendered = 0
    for conv in convs:
        for tools in (None, TOOLS):
            for kw in KWARGS:
                expected = outcome(theirs, CONVERSATIONS[conv], tools, kw)
                assert outcome(ours, CONVERSATIONS[conv], tools, kw) == expected, (conv, tools, kw)
                n_rendered += not expected.startswith("refused")
    assert n_rendered >= 6  # most of the comparisons are of real prompts, not of two refusals


def test_llama3_matches_llama_3_2_given_its_date() -> None:
    # Llama 3.2's template writes today's date; with date_string given, both use it
    ours = ChatTemplate("llama3", BUILTIN["llama3"])
    theirs = ChatTemplate("3.2", (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text())
    kw = {"date_string": "01 Jan 2026"}
    for messages in CONVERSATIONS.values():
        assert outcome(ours, messages, TOOLS, kw) == outcome(theirs, messages, TOOLS, kw)


def test_gemma_folds_the_system_turn_as_gemma_3_does() -> None:
    text = load_chat_template(None, None, "gemma3").apply(CONVERSATIONS["plain"])
    assert text.startswith("<start_of_turn>user\n  Be brief.  \n\nHello!<end_of_turn>\n")


def test_every_builtin_compiles_and_renders_a_plain_conversation() -> None:
    for name, src in BUILTIN.items():
        text = ChatTemplate(name, src).apply(CONVERSATIONS["no-system"])
        assert "Hello!" in text and "Bye" in text, name
