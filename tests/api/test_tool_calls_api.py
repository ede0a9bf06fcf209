"""Tool calls and reasoning through /v1/chat/completions with the official openai client.

The fake engine "generates" a fixed reply (the text a model would write in its template's
syntax), so these test the wiring (rendering, parsing, the response and stream shapes, the
refusals), not a model's skill.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.api.test_openai import _close_openai_clients, engine_of, oai  # noqa: F401

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
MSGS: Any = [{"role": "user", "content": "Weather in Paris?"}]
XML_REPLY = (
    "The user wants the weather.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
    "</tool_call>"
)
HERMES_CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
HERMES_REPLY = "<think>\nTwo cities.\n</think>\n\n" + "\n".join(
    HERMES_CALL.format(c) for c in ("Paris", "Rome")
)


async def qwen35(make_client: Any, reply: str, **kw: Any) -> Any:
    return await make_client(chat_template="qwen3.5", n_ctx=4096, reply=reply.encode(), **kw)


async def test_tools_auto_returns_tool_calls(make_client: Any) -> None:
    client = await qwen35(make_client, XML_REPLY)
    r = await oai(client).chat.completions.create(model="x", messages=MSGS, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me look."
    assert msg.model_extra is not None
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert msg.tool_calls is not None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]
    prompt = bytes(t for t in engine_of(client).submitted[-1].prompt if t < 256).decode()
    assert '"name": "get_weather"' in prompt and prompt.endswith("<think>\n")


async def streamed(client: Any, **kw: Any) -> tuple[list[Any], dict[str, Any]]:
    """The chunks, and what they join to: reasoning, content, calls by index, finish reasons."""
    stream = await oai(client).chat.completions.create(
        model="x", messages=MSGS, tools=TOOLS, stream=True, **kw
    )
    chunks = [c async for c in stream]
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": []}
    for c in chunks:
        d = c.choices[0].delta
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        out["finish"].append(c.choices[0].finish_reason)
        for tc in d.tool_calls or []:
            if tc.id is not None:  # the opening chunk of a call
                assert tc.index not in out["calls"] and tc.type == "function"
                assert tc.function is not None and tc.function.arguments == ""
                out["calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
            else:
                assert tc.function is not None and tc.function.name is None
                out["calls"][tc.index]["args"] += tc.function.arguments
    return chunks, out


@pytest.mark.parametrize("template", ["qwen3.5", "qwen3"])
async def test_streamed_calls_join_to_the_non_streamed_answer(
    make_client: Any, template: str
) -> None:
    reply = XML_REPLY if template == "qwen3.5" else HERMES_REPLY
    client = await make_client(chat_template=template, n_ctx=4096, reply=reply.encode())
    r = await oai(client).chat.completions.create(model="x", messages=MSGS, tools=TOOLS)
    msg = r.choices[0].message
    chunks, out = await streamed(client)
    assert out["finish"][-1] == "tool_calls" and out["finish"].count("tool_calls") == 1
    assert out["content"] == (msg.content or "")
    assert out["reasoning"] == msg.model_extra["reasoning_content"]  # type: ignore[index]
    assert msg.tool_calls is not None
    calls = [out["calls"][i] for i in sorted(out["calls"])]
    assert [(c["name"], json.loads(c["args"])) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments))  # type: ignore[union-attr]
        for t in msg.tool_calls
    ]
    assert len(calls) == (1 if template == "qwen3.5" else 2)
    # a stream of the qwen3.5 reply streams the string parameter in pieces, not in one chunk
    n_arg_chunks = sum(1 for c in chunks for tc in c.choices[0].delta.tool_calls or [])
    assert n_arg_chunks > len(calls) + 1


async def test_tool_choice_none_leaves_calls_as_text(make_client: Any) -> None:
    client = await qwen35(make_client, XML_REPLY)
    r = await oai(client).chat.completions.create(
        model="x", messages=MSGS, tools=TOOLS, tool_choice="none"
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.tool_calls is None
    assert msg.content is not None and msg.content.startswith("Let me look.\n\n<tool_call>")
    prompt = bytes(t for t in engine_of(client).submitted[-1].prompt if t < 256).decode()
    assert '"name": "get_weather"' in prompt  # the tools are still rendered, as llama-server does


async def test_parallel_tool_calls_false_keeps_the_first(make_client: Any) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=4096, reply=HERMES_REPLY.encode())
    r = await oai(client).chat.completions.create(
        model="x", messages=MSGS, tools=TOOLS, parallel_tool_calls=False
    )
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


async def test_a_malformed_call_is_content(make_client: Any) -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>'
    client = await make_client(chat_template="qwen3", n_ctx=4096, reply=reply.encode())
    r = await oai(client).chat.completions.create(model="x", messages=MSGS, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == reply and r.choices[0].message.tool_calls is None
    _, out = await streamed(client)
    assert out["content"] == reply and out["calls"] == {} and out["finish"][-1] == "stop"


async def test_reasoning_format_none_keeps_the_raw_text(make_client: Any) -> None:
    client = await qwen35(make_client, "Thinking.\n</think>\n\nHi!")
    api = oai(client)
    r = await api.chat.completions.create(model="x", messages=MSGS)
    assert r.choices[0].message.content == "Hi!"
    assert r.choices[0].message.model_extra["reasoning_content"] == "Thinking."  # type: ignore[index]
    r = await api.chat.completions.create(
        model="x", messages=MSGS, extra_body={"reasoning_format": "none"}
    )
    assert r.choices[0].message.content == "Thinking.\n</think>\n\nHi!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    client = await qwen35(make_client, "Thinking.\n</think>\n\nHi!", reasoning_format="none")
    r = await oai(client).chat.completions.create(model="x", messages=MSGS)
    assert r.choices[0].message.content == "Thinking.\n</think>\n\nHi!"
    r = await oai(client).chat.completions.create(
        model="x", messages=MSGS, extra_body={"reasoning_format": "deepseek"}
    )
    assert r.choices[0].message.content == "Hi!"


@pytest.mark.parametrize(
    ("kw", "param", "says"),
    [
        ({"extra_body": {"reasoning_format": "deepseek-legacy"}}, "reasoning_format", "one of"),
    ],
)
async def test_what_is_not_implemented_is_refused(
    make_client: Any, kw: dict[str, Any], param: str, says: str
) -> None:
    client = await qwen35(make_client, XML_REPLY)
    with pytest.raises(openai.BadRequestError) as e:
        await oai(client).chat.completions.create(model="x", messages=MSGS, tools=TOOLS, **kw)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == param and says in err["message"], err


async def test_tools_on_a_template_without_tool_calls(make_client: Any) -> None:
    client = await make_client()  # the built-in Gemma template: no tool-call syntax
    api = oai(client)
    with pytest.raises(openai.BadRequestError) as e:
        await api.chat.completions.create(model="x", messages=MSGS, tools=TOOLS)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "tools"
    assert "writes no tool calls" in e.value.body["message"]
    r = await api.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == "Hello, world!"
