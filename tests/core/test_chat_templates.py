"""Every chat template llama.cpp ships (tests/data/templates/, its models/templates) renders a plain
and a tool-calling conversation as OpenAI clients send them, except where the template itself
refuses on purpose, listed here with the template's own message.

Where transformers' own renderer can render the same input, its output is the oracle: ours must be
identical (same tojson, namespace, trim/lstrip rules). It cannot for the few templates that need
what its immutable sandbox lacks, which are listed too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mgserve.core.text.chat import ChatTemplate, TemplateError
from mgserve.core.text.chat_messages import normalize_messages, normalize_tools

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))

PLAIN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Name three colours."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "description": "celsius or fahrenheit"},
                },
                "required": ["city"],
            },
        },
    }
]


def tool_conversation(call_id: str = "call_0f3a9c2e") -> list[dict[str, Any]]:
    """As the openai client sends it: arguments a JSON string, content null beside tool calls."""
    fn = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    return [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees, sunny"},
        {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
        {"role": "user", "content": "Thanks! And in Rome?"},
    ]


CONVERSATIONS = {"plain": (PLAIN, None), "tool": (tool_conversation(), TOOLS)}
MUST_SHOW = {
    "plain": ["Hello!", "Hi, how can I help?", "Name three colours."],
    "tool": ["What's the weather in Paris?", "18 degrees, sunny", "It is 18 degrees", "in Rome?"],
}
CALL_SHOWN = [
    "get_weather",
    "celsius",
]  # the tool's name and a value only the call's arguments hold

# The templates' own refusals of these conversations: (template, conversation) -> its message.
REFUSES = {
    ("google-gemma-2-2b-it", "plain"): "System role not supported",
    ("google-gemma-2-2b-it", "tool"): (
        "Conversation roles must alternate user/assistant/user/assistant/..."
    ),
    ("Mistral-Small-3.2-24B-Instruct-2506", "tool"): (
        "Tool call IDs should be alphanumeric strings with length 9!"
    ),
    ("mistralai-Mistral-Nemo-Instruct-2407", "tool"): (
        "Tool call IDs should be alphanumeric strings with length 9!"
    ),
}
# Variables a template reads that its authors pass themselves (Fireworks' card: functions as a JSON
# string and the date); a client sends them in chat_template_kwargs.
KWARGS = {
    "fireworks-ai-llama-3-firefunction-v2": {
        "functions": json.dumps([t["function"] for t in TOOLS]),
        "datetime": "Dec 03 2026",
    }
}
# Templates that show neither tool descriptions nor tool calls, by design (no tool support).
NO_TOOL_CALLS = {
    "HuggingFaceTB-SmolLM3-3B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "llama-cpp-rwkv-world",
    "microsoft-Phi-3.5-mini-instruct",
}
# ...and of those, these render only system/user/assistant turns: a tool reply is left out.
NO_TOOL_ROLE = {"llama-cpp-rwkv-world", "microsoft-Phi-3.5-mini-instruct"}
# ...or show the tool descriptions but not the arguments of past calls.
NO_CALL_ARGUMENTS = {"LFM2-8B-A1B", "LFM2.5-Instruct", "ibm-granite-granite-3.3-2B-Instruct"}
# What transformers' immutable sandbox cannot render (lists changed in place; tojson of map()).
TRANSFORMERS_CANNOT = {
    ("Kimi-K2-Instruct", "tool"),
    ("Kimi-K2-Thinking", "tool"),
    ("llama-cpp-deepseek-r1", "tool"),
}


def load(name: str) -> ChatTemplate:
    return ChatTemplate(name, (TEMPLATES / f"{name}.jinja").read_text(), "<s>", "</s>")


def test_all_of_llama_cpps_templates_are_here() -> None:
    assert len(NAMES) == 70, "rerun tests/data/copy_llama_templates.py"


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("name", NAMES)
def test_template_renders_or_refuses_on_purpose(name: str, conv: str) -> None:
    messages, tools = CONVERSATIONS[conv]
    template = load(name)
    refusal = REFUSES.get((name, conv))
    if refusal is not None:
        with pytest.raises(TemplateError) as e:
            template.apply(messages, tools=tools, kwargs=KWARGS.get(name))
        assert str(e.value) == refusal
        return
    text = template.apply(messages, tools=tools, kwargs=KWARGS.get(name))
    must = MUST_SHOW[conv]
    if conv == "tool" and name in NO_TOOL_ROLE:
        must = [m for m in must if m != "18 degrees, sunny"]
    if conv == "tool" and name not in NO_TOOL_CALLS:
        must = must + (CALL_SHOWN[:1] if name in NO_CALL_ARGUMENTS else CALL_SHOWN)
    missing = [m for m in must if m not in text]
    assert not missing, f"{name} lost {missing}:\n{text}"


@pytest.mark.parametrize("name", NAMES)
def test_same_output_as_transformers(name: str) -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    ours = load(name)
    theirs = _compile_jinja_template((TEMPLATES / f"{name}.jinja").read_text())
    for conv, (messages, tools) in CONVERSATIONS.items():
        if (name, conv) in REFUSES:
            continue
        context: dict[str, Any] = {
            "messages": normalize_messages(messages, ours.object_arguments),
            "add_generation_prompt": True,
            "bos_token": "<s>",
            "eos_token": "</s>",
            **KWARGS.get(name, {}),
        }
        if tools:
            context["tools"] = normalize_tools(tools)
        if (name, conv) in TRANSFORMERS_CANNOT:
            with pytest.raises(Exception):  # noqa: B017 -- whichever its sandbox raises
                theirs.render(**context)
            continue
        expected = theirs.render(**context).removeprefix("<s>")
        assert ours.apply(messages, tools=tools, kwargs=KWARGS.get(name)) == expected


def test_refusing_templates_render_what_they_accept() -> None:
    # Gemma 2: no system turn, no tool role; Mistral: 9-character alphanumeric call ids
    text = load("google-gemma-2-2b-it").apply(PLAIN[1:])
    assert text.endswith(
        "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"
    )
    for name in ("Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407"):
        text = load(name).apply(tool_conversation("a1B2c3D4e"), tools=TOOLS)
        assert "a1B2c3D4e" in text and "celsius" in text and "sunny" in text


def test_firefunction_without_its_variables_says_which() -> None:
    with pytest.raises(TemplateError, match="'functions' is undefined.*chat_template_kwargs"):
        load("fireworks-ai-llama-3-firefunction-v2").apply(PLAIN)


def test_only_functionary_v3_2_takes_arguments_as_strings() -> None:
    strings = [n for n in NAMES if not load(n).object_arguments]
    assert strings == ["meetkai-functionary-medium-v3.2"]
    text = load("meetkai-functionary-medium-v3.2").apply(tool_conversation(), tools=TOOLS)
    assert '>>>get_weather\n{"city": "Paris", "unit": "celsius"}' in text


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "Qwen3.5-4B"])
def test_enable_thinking_false_closes_the_think_block(name: str) -> None:
    t = load(name)
    assert t.apply(PLAIN, kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert not t.apply(PLAIN).endswith("</think>\n\n")
