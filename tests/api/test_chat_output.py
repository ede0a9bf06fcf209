"""The chat-output parser on what real templates write: each tool-call format's round trip (the
model family's own template renders an assistant turn with tool calls, the parser reads the turn
back to the same OpenAI calls), fed whole and one character at a time; malformed calls stay text;
reasoning split with and without its opening tag."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mgserve.api.chat_output import (
    ChatFormat,
    ChatOutputParser,
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    detect_format,
)
from mgserve.core.text.chat import BUILTIN, ChatTemplate

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "hourly": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            },
        },
    },
]
CALLS = [
    ("get_weather", {"city": "Paris\nFrance", "days": 3, "hourly": True}),
    ("search", {"query": 'say "hi" </tool', "filters": {"lang": ["en", "fr"]}}),
]
ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>")

# (template, special tokens it is rendered with, format, calls it can write in one turn)
CASES = [
    ("Qwen3.5-4B", "", "<|im_end|>", "xml", 2),
    ("Qwen3-Coder", "", "<|im_end|>", "xml", 2),
    ("builtin:qwen3.5", "", "<|im_end|>", "xml", 2),
    ("Qwen-Qwen3-0.6B", "", "<|im_end|>", "hermes", 2),
    ("Qwen-Qwen2.5-7B-Instruct", "", "<|im_end|>", "hermes", 2),
    ("Qwen-QwQ-32B", "", "<|im_end|>", "hermes", 2),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "<s>", "</s>", "hermes", 2),
    ("builtin:qwen3", "", "<|im_end|>", "hermes", 2),
    ("builtin:qwen2.5", "", "<|im_end|>", "hermes", 2),
    ("meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>", "llama3", 1),
    ("meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>", "llama3", 1),
    ("meta-llama-Llama-3.3-70B-Instruct", "<|begin_of_text|>", "<|eot_id|>", "llama3", 1),
    ("builtin:llama3", "<|begin_of_text|>", "<|eot_id|>", "llama3", 1),
    ("mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>", "mistral", 2),
    ("Mistral-Small-3.2-24B-Instruct-2506", "<s>", "</s>", "mistral", 2),
    ("unsloth-mistral-Devstral-Small-2507", "<s>", "</s>", "mistral", 2),
]


def template(name: str, bos: str, eos: str) -> ChatTemplate:
    if name.startswith("builtin:"):
        return ChatTemplate(name, BUILTIN[name[8:]], bos, eos)
    return ChatTemplate(name, (TEMPLATES / f"{name}.jinja").read_text(), bos, eos)


def openai_calls(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call{i}abcd",  # 9 characters: Mistral's templates insist
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for i, (name, args) in enumerate(CALLS[:n])
    ]


def parse(parser: ChatOutputParser, text: str, step: int) -> list[Event]:
    events: list[Event] = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    return events + parser.finish()


def joined(events: list[Event]) -> tuple[str, str, list[tuple[str, Any]]]:
    """(reasoning, content, [(name, arguments parsed)]) of an event list, checking its order."""
    calls: dict[int, list[str]] = {}
    open_call: int | None = None
    for e in events:
        if isinstance(e, ToolCallStart):
            assert open_call is None and e.index not in calls and e.id
            calls[e.index], open_call = [e.name, ""], e.index
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index == open_call
            calls[e.index][1] += e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index == open_call
            open_call = None
    assert open_call is None
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning, content, [(n, json.loads(a)) for n, a in calls.values()]


def rendered_turn(tmpl: ChatTemplate, n: int) -> tuple[str, str]:
    """(the prompt, the assistant turn the template writes after it, end-of-turn cut off)."""
    user = {"role": "user", "content": "Weather in Paris, and search?"}
    turn = {"role": "assistant", "content": None, "tool_calls": openai_calls(n)}
    prompt = tmpl.apply([user], add_generation_prompt=True, tools=TOOLS)
    full = tmpl.apply([user, turn], add_generation_prompt=False, tools=TOOLS)
    # QwQ's prompt opens a think block that its history turns do not show: the turn is what
    # follows the part both share
    shared = prompt
    if not full.startswith(prompt):  # whole lines: "<t" of "<think>" is no start of "<tool_call>"
        shared = os.path.commonprefix([prompt, full])
        shared = shared[: shared.rfind("\n") + 1]
    out = full[len(shared) :]
    cut = min((out.find(e) for e in ENDS if e in out), default=len(out))
    return shared, out[:cut]


@pytest.mark.parametrize(("name", "bos", "eos", "fmt", "n"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_round_trip(name: str, bos: str, eos: str, fmt: str, n: int, step: int) -> None:
    tmpl = template(name, bos, eos)
    chat_format = detect_format(tmpl.source)
    assert chat_format.tools == fmt
    prompt, out = rendered_turn(tmpl, n)
    think_open = chat_format.think is not None and prompt.rstrip().endswith(chat_format.think[0])
    parser = ChatOutputParser(chat_format, tools_enabled=True, tools=TOOLS, think_open=think_open)
    reasoning, content, calls = joined(parse(parser, out, step))
    assert calls == CALLS[:n], out
    assert content == "" and reasoning == "", out
    assert parser.has_calls


def test_formats_of_templates_without_tool_calls() -> None:
    assert detect_format(BUILTIN["gemma"]) == ChatFormat("none", None)
    gemma2 = (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text()
    assert detect_format(gemma2).tools == "none"
    ministral = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()
    assert detect_format(ministral) == ChatFormat("mistral", ("[THINK]", "[/THINK]"))
