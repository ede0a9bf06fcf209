"""``n`` > 1 choices on the fake engine: requests, seeds, envelopes, streams, usage, disconnects."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from mgserve.api.app import create_app
from mgserve.api.choices import choice_requests, choice_seed
from mgserve.api.http import SERVICE
from mgserve.core.engine.contract import Request, SamplingParams
from tests.api.conftest import fake_service
from tests.api.fakes import FakeEngine
from tests.api.test_disconnect import wait_idle
from tests.api.test_tool_calls_api import MSGS, TOOLS, XML_REPLY, qwen35

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "n": 2}
REPLY = "Hello, world!"


def engine_of(client: TestClient[Any, Any]) -> FakeEngine:
    return client.server.app[SERVICE].engine  # type: ignore[return-value]


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    """The data of every event; the last is the literal "[DONE]"."""
    assert resp.status == 200, await resp.text()
    out: list[Any] = []
    for line in (await resp.text()).splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def test_choice_seeds() -> None:
    assert choice_seed(7, 0) == 7  # choice 0 is the request with n=1
    seeds = [choice_seed(7, i) for i in range(1, 4)]
    assert seeds == [choice_seed(7, i) for i in range(1, 4)]  # the same every time
    assert len({7, *seeds}) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(8, 1) != seeds[0]
    req = Request("r", [1, 2], SamplingParams(seed=7), max_tokens=4)
    reqs = choice_requests(req, 3)
    assert [r.id for r in reqs] == ["r-0", "r-1", "r-2"]
    assert [r.sampling.seed for r in reqs] == [7, *seeds[:2]]
    assert all(r.prompt is req.prompt and r.max_tokens == 4 for r in reqs)
    assert choice_requests(req, 1) == [req]
    unseeded = Request("u", [1], SamplingParams(), max_tokens=1)
    assert [r.sampling.seed for r in choice_requests(unseeded, 2)] == [None, None]


async def test_chat_n2_whole(client: TestClient[Any, Any]) -> None:
    r = await client.post("/v1/chat/completions", json=CHAT | {"seed": 5})
    body = await r.json()
    assert r.status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert c["message"] == {"role": "assistant", "content": REPLY}
        assert c["finish_reason"] == "stop"
    reqs = engine_of(client).submitted
    assert len(reqs) == 2 and reqs[0].prompt == reqs[1].prompt
    assert [q.sampling.seed for q in reqs] == [5, choice_seed(5, 1)]
    per_choice = len(REPLY) + 1  # the eos token counts
    assert body["usage"]["prompt_tokens"] == len(reqs[0].prompt)  # once, not twice
    assert body["usage"]["completion_tokens"] == 2 * per_choice
    assert body["usage"]["total_tokens"] == len(reqs[0].prompt) + 2 * per_choice
    assert body["timings"]["predicted_n"] == 2 * per_choice


async def test_completions_n2_with_stop_and_max_tokens(client: TestClient[Any, Any]) -> None:
    body = {"prompt": "x", "n": 2, "stop": [","]}
    choices = (await (await client.post("/v1/completions", json=body)).json())["choices"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "Hello", "stop"),
        (1, "Hello", "stop"),
    ]
    body = {"prompt": "x", "n": 2, "max_tokens": 3, "echo": True}
    choices = (await (await client.post("/v1/completions", json=body)).json())["choices"]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [("xHel", "length")] * 2


async def test_logprobs_per_choice(client: TestClient[Any, Any]) -> None:
    body = {"prompt": "x", "n": 2, "max_tokens": 3, "logprobs": 1}
    choices = (await (await client.post("/v1/completions", json=body)).json())["choices"]
    for c in choices:  # each choice's offsets count its own text
        assert c["logprobs"]["tokens"] == ["H", "e", "l"]
        assert c["logprobs"]["text_offset"] == [0, 1, 2]


@pytest.mark.parametrize("chat", [True, False])
async def test_streamed_n2(client: TestClient[Any, Any], chat: bool) -> None:
    path, body = (
        ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", {"prompt": "x", "n": 2})
    )
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    events = await sse_events(await client.post(path, json=body))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * (len(REPLY) + 1)
    chunks = events[:-2]
    assert all(len(e["choices"]) == 1 for e in chunks)
    order = [e["choices"][0]["index"] for e in chunks]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # interleaved as they come
    for i in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        key = "content" if chat else "text"
        text = "".join((c["delta"].get(key) or "") if chat else c["text"] for c in mine)
        assert text == REPLY
        assert [c["finish_reason"] for c in mine][-1] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        if chat:
            assert mine[0]["delta"]["role"] == "assistant"


async def test_openai_client_reads_n_choices(client: TestClient[Any, Any]) -> None:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        msgs = CHAT["messages"]
        r = await api.chat.completions.create(model="x", messages=msgs, n=2)  # type: ignore[arg-type]
        assert [c.message.content for c in r.choices] == [REPLY, REPLY]
        stream = await api.completions.create(model="x", prompt="x", n=2, stream=True)
        texts = ["", ""]
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [REPLY, REPLY]
    finally:
        await api.close()


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_cancels_every_choice(stream: bool) -> None:
    service = fake_service(reply=b"", step_s=0.02)
    engine: FakeEngine = service.engine  # type: ignore[assignment]
    server = TestServer(create_app(service))
    await server.start_server()
    body = {"prompt": "x", "n": 2, "max_tokens": 200, "ignore_eos": True, "stream": stream}
    try:
        async with aiohttp.ClientSession() as session:
            url = str(server.make_url("/v1/completions"))
            if stream:
                resp = await session.post(url, json=body)
                await resp.content.readline()
                resp.close()
            else:
                task = asyncio.create_task(session.post(url, json=body))
                while engine.busy() < 2:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_idle(engine)
            assert engine.n_aborted == 2 and len(engine.submitted) == 2
    finally:
        await server.close()


async def test_a_failed_choice_fails_the_request(make_client: Any) -> None:
    client = await make_client(fail_at=3)
    r = await client.post("/v1/completions", json={"prompt": "x", "n": 2})
    assert r.status == 500
    events = await sse_events(
        await client.post("/v1/completions", json={"prompt": "x", "n": 2, "stream": True})
    )
    assert "error" in events[-1]


async def test_each_choice_reads_its_own_tool_calls(make_client: Any) -> None:
    client = await qwen35(make_client, XML_REPLY)
    body = {"messages": MSGS, "tools": TOOLS, "n": 2}
    r = await (await client.post("/v1/chat/completions", json=body)).json()
    assert [c["finish_reason"] for c in r["choices"]] == ["tool_calls"] * 2
    for c in r["choices"]:
        assert c["message"]["content"] == "Let me look."
        assert c["message"]["reasoning_content"] == "The user wants the weather."
        (call,) = c["message"]["tool_calls"]
        assert orjson.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    events = await sse_events(
        await client.post("/v1/chat/completions", json=body | {"stream": True})
    )
    calls: dict[int, str] = {0: "", 1: ""}
    for e in events[:-1]:
        (c,) = e["choices"]
        for tc in c["delta"].get("tool_calls") or []:
            calls[c["index"]] += tc["function"]["arguments"]
        if c["finish_reason"] is not None:
            assert c["finish_reason"] == "tool_calls"
    assert [orjson.loads(a) for a in calls.values()] == [{"city": "Paris", "days": 2}] * 2
