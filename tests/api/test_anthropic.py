"""/v1/messages through the official anthropic client, on the fake engine: the response and its
stream, stop reasons, the prompts requests render to, and refusals in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import orjson
import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.http import SERVICE
from tests.api.fakes import FakeEngine, FakeTokenizer

USER = [{"role": "user", "content": "Hi"}]
GEMMA_PROMPT = "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
_opened: list[anthropic.AsyncAnthropic] = []


def api(client: TestClient[Any, Any], key: str = "none") -> anthropic.AsyncAnthropic:
    a = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=key, max_retries=0)
    _opened.append(a)
    return a


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().close()


def engine_of(client: TestClient[Any, Any]) -> FakeEngine:
    return client.server.app[SERVICE].engine  # type: ignore[return-value]


def prompt_of(client: TestClient[Any, Any]) -> str:
    """The last submitted prompt as text (the fake tokenizer is byte-level)."""
    return FakeTokenizer().decode(engine_of(client).submitted[-1].prompt[1:])


async def test_message(client: TestClient[Any, Any]) -> None:
    r = await api(client).messages.create(
        model="x", max_tokens=64, system="Be brief.", messages=USER, metadata={"user_id": "u1"}
    )
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == "fake-model"
    assert [b.model_dump(exclude_none=True) for b in r.content] == [
        {"type": "text", "text": "Hello, world!"}
    ]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert prompt_of(client) == GEMMA_PROMPT  # the system prompt, as Gemma folds it
    n_prompt = len(engine_of(client).submitted[-1].prompt)
    assert r.usage.input_tokens == n_prompt and r.usage.cache_read_input_tokens == 0
    assert r.usage.output_tokens == len("Hello, world!") + 1  # the eos token counts
    counted = await api(client).messages.count_tokens(model="x", system="Be brief.", messages=USER)
    assert counted.input_tokens == n_prompt


async def test_system_as_blocks_and_user_text_blocks(client: TestClient[Any, Any]) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    content = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    await api(client).messages.create(
        model="x",
        max_tokens=8,
        system=system,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": content}],  # type: ignore[typeddict-item]
    )
    assert prompt_of(client) == GEMMA_PROMPT.replace("Hi", "H\ni")


async def test_stream_events_and_accumulated_message(client: TestClient[Any, Any]) -> None:
    whole = await api(client).messages.create(model="x", max_tokens=64, messages=USER)
    async with api(client).messages.stream(model="x", max_tokens=64, messages=USER) as stream:
        kinds = [ev.type async for ev in stream]
        streamed = await stream.get_final_message()
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    # the raw events, as Anthropic sends them: named, in this order, one text block
    body = {"model": "x", "max_tokens": 64, "messages": USER, "stream": True}
    resp = await client.post("/v1/messages", json=body)
    raw = (await resp.read()).decode().strip().split("\n\n")
    names = [e.split("\n")[0].removeprefix("event: ") for e in raw]
    datas = [orjson.loads(e.split("\n")[1].removeprefix("data: ")) for e in raw]
    assert [d["type"] for d in datas] == names
    n_text = len("Hello, world!")
    assert names == ["message_start", "ping", "content_block_start"] + [
        "content_block_delta"
    ] * n_text + ["content_block_stop", "message_delta", "message_stop"]
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["stop_reason"] is None
    assert datas[2]["content_block"] == {"type": "text", "text": ""}
    assert datas[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == n_text + 1
    assert "text" in kinds  # the SDK's own text events came through


async def test_stop_sequence_and_max_tokens(client: TestClient[Any, Any]) -> None:
    r = await api(client).messages.create(
        model="x", max_tokens=64, messages=USER, stop_sequences=["zzz", "o, w"]
    )
    assert r.content[0].type == "text" and r.content[0].text == "Hell"
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "o, w"
    r = await api(client).messages.create(model="x", max_tokens=5, messages=USER)
    assert r.content[0].type == "text" and r.content[0].text == "Hello"
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5
    async with api(client).messages.stream(
        model="x", max_tokens=64, messages=USER, stop_sequences=["o, w"]
    ) as stream:
        m = await stream.get_final_message()
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "o, w"


async def test_max_tokens_past_the_context_stops_at_its_end(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(n_ctx=24)  # the prompt is 18 tokens: 6 are left
    r = await api(client).messages.create(model="x", max_tokens=16_000, messages=USER)
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == 6


async def test_prefill_continues_the_trailing_assistant_turn(client: TestClient[Any, Any]) -> None:
    msgs = [*USER, {"role": "assistant", "content": "Well,"}]
    await api(client).messages.create(model="x", max_tokens=8, messages=msgs)  # type: ignore[arg-type]
    assert prompt_of(client) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nWell,"


TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": TOOL["input_schema"],
    },
}


async def _openai_prompt(client: TestClient[Any, Any], body: dict[str, Any]) -> str:
    resp = await client.post("/v1/chat/completions", json=body | {"max_tokens": 1})
    assert resp.status == 200, await resp.text()
    return prompt_of(client)


async def test_tools_render_as_the_templates_function_tools(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=2048)
    await api(client).messages.create(model="x", max_tokens=8, messages=USER, tools=[TOOL])  # type: ignore[list-item]
    prompt = prompt_of(client)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert '"description": "The weather in a city"' in prompt
    assert prompt == await _openai_prompt(client, {"messages": USER, "tools": [OPENAI_TOOL]})
    # tool_choice none: the tools stay out of the prompt
    await api(client).messages.create(
        model="x",
        max_tokens=8,
        messages=USER,
        tools=[TOOL],
        tool_choice={"type": "none"},  # type: ignore[list-item]
    )
    assert "get_weather" not in prompt_of(client)


async def test_tool_use_and_tool_result_render_as_calls_and_tool_messages(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=2048)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    msgs = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Ask the tool.", "signature": ""},
                {"type": "text", "text": "Let me look."},
                call,
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    await api(client).messages.create(model="x", max_tokens=8, messages=msgs, tools=[TOOL])  # type: ignore[arg-type, list-item]
    prompt = prompt_of(client)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\nSunny\n</tool_response>" in prompt
    openai_msgs = [
        msgs[0],
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Ask the tool.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert prompt == await _openai_prompt(client, {"messages": openai_msgs, "tools": [OPENAI_TOOL]})


async def test_thinking_sets_the_templates_switch(make_client: Callable[..., Any]) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=2048)
    off = {"type": "disabled"}
    await api(client).messages.create(model="x", max_tokens=8, messages=USER, thinking=off)  # type: ignore[arg-type]
    assert prompt_of(client).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = {"type": "enabled", "budget_tokens": 1024}
    await api(client).messages.create(model="x", max_tokens=2048, messages=USER, thinking=on)  # type: ignore[arg-type]
    assert prompt_of(client).endswith("<|im_start|>assistant\n")


async def test_a_failure_mid_stream_is_an_error_event(make_client: Callable[..., Any]) -> None:
    client = await make_client(fail_at=3)
    with pytest.raises(anthropic.APIStatusError) as e:
        async with api(client).messages.stream(model="x", max_tokens=64, messages=USER) as s:
            await s.get_final_message()
    assert e.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "generation failed: device lost"},
    }


async def test_api_key_as_anthropic_clients_send_it(make_client: Callable[..., Any]) -> None:
    client = await make_client(api_key="secret")
    r = await api(client, key="secret").messages.create(model="x", max_tokens=4, messages=USER)
    assert r.stop_reason == "max_tokens"
    with pytest.raises(anthropic.AuthenticationError) as e:
        await api(client, key="wrong").messages.create(model="x", max_tokens=4, messages=USER)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }


async def test_a_failed_tool_result_says_so(make_client: Callable[..., Any]) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=2048)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "X"}}
    failed = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "no such city"}],
        "is_error": True,
    }
    msgs = [*USER, {"role": "assistant", "content": [call]}, {"role": "user", "content": [failed]}]
    await api(client).messages.create(model="x", max_tokens=8, messages=msgs, tools=[TOOL])  # type: ignore[arg-type, list-item]
    assert "<tool_response>\nError: no such city\n</tool_response>" in prompt_of(client)


async def test_a_system_turn_in_messages(client: TestClient[Any, Any]) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, *USER]
    await api(client).messages.create(model="x", max_tokens=8, messages=msgs)  # type: ignore[arg-type]
    assert prompt_of(client) == GEMMA_PROMPT


async def test_reasoning_and_tool_calls_become_thinking_and_tool_use_blocks(
    make_client: Callable[..., Any],
) -> None:
    """The chat output parser behind the route: a Qwen3 reply with a think block and two
    Hermes-style calls is a thinking block and two tool_use blocks, stop_reason tool_use, whole
    and streamed alike."""
    from tests.api.test_tool_calls_api import HERMES_REPLY

    client = await make_client(chat_template="qwen3", n_ctx=4096, reply=HERMES_REPLY.encode())
    body = {"model": "x", "max_tokens": 256, "messages": USER, "tools": [TOOL]}
    whole = await api(client).messages.create(**body)  # type: ignore[arg-type]
    assert whole.stop_reason == "tool_use"
    kinds = [b.type for b in whole.content]
    assert kinds == ["thinking", "tool_use", "tool_use"], kinds
    assert whole.content[0].thinking.strip() == "Two cities."  # type: ignore[union-attr]
    calls = [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    async with api(client).messages.stream(**body) as s:  # type: ignore[arg-type]
        streamed = await s.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]
    assert streamed.stop_reason == "tool_use"
