"""Admission through the API, on the real engine over the fake model: a full queue is a 503 with
Retry-After (in Anthropic's shape on /v1/messages), id_slot pins a slot, cache_prompt: false
computes the whole prompt, return_progress streams prompt progress as llama-server does, and 200
clients that go away at random points leave no slot busy and nothing queued."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from mgserve.api.app import create_app
from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from tests.api.conftest import fake_service
from tests.api.fakes import N_VOCAB
from tests.core.fake_model import FakeModel
from tests.prom import metric

HOLD = {"prompt": "x", "n_predict": 200, "ignore_eos": True, "stream": True, "n_probs": 1}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def real_engine(parallel: int = 2, max_queue: int = 64, delay: float = 0.0) -> Engine:
    settings = Settings(parallel=parallel, ctx_size=256, batch_size=8, max_queue=max_queue)
    return Engine(FakeModel(n_vocab=N_VOCAB, delay=delay), settings)


async def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Until no slot is busy, nothing is queued and no request is open."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while engine._sched.n_busy or engine._sched.queue or engine._streams:
        assert loop.time() < end, f"not idle: {engine.slots()} {engine.stats}"
        await asyncio.sleep(0.01)


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    out = []
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            out.append(orjson.loads(line[6:]))
    return out


@pytest.mark.parametrize(
    ("path", "body", "anthropic"),
    [
        ("/completion", {"prompt": "a"}, False),
        ("/v1/chat/completions", CHAT | {"stream": True}, False),
        ("/v1/messages", CHAT, True),
    ],
)
async def test_a_full_queue_is_a_503_with_retry_after(
    make_client: Callable[..., Any], path: str, body: dict[str, Any], anthropic: bool
) -> None:
    engine = real_engine(parallel=1, max_queue=0, delay=0.005)
    client = await make_client(engine=engine)
    holder = await client.post("/completion", json=HOLD)
    await holder.content.readline()  # generating: the one slot is taken
    r = await client.post(path, json=body)
    assert r.status == 503 and 1 <= int(r.headers["Retry-After"]) <= 60
    got = await r.json()
    if anthropic:
        assert got["type"] == "error" and got["error"]["type"] == "overloaded_error"
    else:
        assert got["error"]["type"] == "unavailable_error" and got["error"]["code"] == 503
        assert "--max-queue" in got["error"]["message"]
    holder.close()
    await wait_idle(engine)
    assert (await client.post(path, json=body)).status == 200  # room again
    assert metric(engine.metrics.registry, "mgserve_requests_rejected_total") == 1


async def test_choices_that_do_not_all_fit_are_refused_whole(
    make_client: Callable[..., Any],
) -> None:
    engine = real_engine(parallel=2, max_queue=0, delay=0.005)
    client = await make_client(engine=engine)
    holder = await client.post("/completion", json=HOLD)
    await holder.content.readline()
    r = await client.post("/v1/completions", json={"prompt": "a", "n": 2, "max_tokens": 3})
    assert r.status == 503
    assert engine._sched.n_busy == 1 and not engine._sched.queue  # choice 0 did not stay
    holder.close()
    await wait_idle(engine)


async def test_id_slot_pins_the_slot(make_client: Callable[..., Any]) -> None:
    engine = real_engine(parallel=2)
    client = await make_client(engine=engine)
    for slot in (1, 0, 1, -1):
        body = {"prompt": "ab", "n_predict": 2, "id_slot": slot}
        got = await (await client.post("/completion", json=body)).json()
        assert got["id_slot"] == slot if slot >= 0 else got["id_slot"] in (0, 1)
    bad = [
        ("/completion", {"prompt": "a", "id_slot": 2}, "must be in [-1, 1]"),
        ("/completion", {"prompt": "a", "id_slot": "0"}, "an integer"),
        ("/v1/chat/completions", CHAT | {"id_slot": 0, "n": 2}, "n > 1"),
    ]
    for path, body, message in bad:
        r = await client.post(path, json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "id_slot" and message in err["message"]


async def test_cache_prompt_false_computes_the_whole_prompt(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client(engine=real_engine(parallel=1))
    body = {"prompt": "the same prompt, twice over", "n_predict": 4, "temperature": 0}
    answers = []
    for cache_prompt in (True, True, False):
        r = await client.post("/completion", json=body | {"cache_prompt": cache_prompt})
        answers.append(await r.json())
    assert [a["timings"]["cache_n"] for a in answers] == [0, 27, 0]
    assert len({a["content"] for a in answers}) == 1
    r = await client.post("/v1/completions", json={"prompt": "a", "cache_prompt": 1})
    assert r.status == 400 and (await r.json())["error"]["param"] == "cache_prompt"


async def test_return_progress_on_completion(make_client: Callable[..., Any]) -> None:
    client = await make_client(engine=real_engine())
    body = {"prompt": "y" * 39, "n_predict": 2, "stream": True, "return_progress": True}
    body |= {"id_slot": 0}
    events = await sse_events(await client.post("/completion", json=body))
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert [p["processed"] for p in progress] == [0, 8, 16, 24, 32, 40]  # BOS + 39, by 8
    assert {(p["total"], p["cache"]) for p in progress} == {(40, 0)}
    assert all(isinstance(p["time_ms"], int) for p in progress)
    first = events[: len(progress)]
    assert all(e["content"] == "" and not e["stop"] and e["id_slot"] >= 0 for e in first)
    assert events[-1]["stop"] and "prompt_progress" not in events[-1]
    # again in the same slot: the cached prefix shows in `cache`, and progress starts there
    events = await sse_events(await client.post("/completion", json=body))
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert [(p["cache"], p["processed"]) for p in progress] == [(39, 39), (39, 40)]


@pytest.mark.parametrize("chat", [True, False])
async def test_return_progress_on_the_openai_routes(
    make_client: Callable[..., Any], chat: bool
) -> None:
    client = await make_client(engine=real_engine())
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", {"prompt": "z"})
    body = body | {"stream": True, "return_progress": True, "max_tokens": 2}
    events = await sse_events(await client.post(path, json=body))
    with_progress = [e for e in events if "prompt_progress" in e]
    assert (
        with_progress
        and with_progress[-1]["prompt_progress"]["processed"]
        == (with_progress[-1]["prompt_progress"]["total"])
    )
    for e in with_progress:
        (choice,) = e["choices"]
        assert choice["finish_reason"] is None
        if chat:
            assert choice["delta"] == {"role": "assistant", "content": None}
        else:
            assert choice["text"] == ""
    r = await client.post(path, json=body | {"stream": False})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "return_progress" and "stream" in err["message"]


async def _client(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    """One client: a random route, streamed or not, gone at a random point (or not at all)."""
    stream = rng.random() < 0.6
    if rng.random() < 0.5:
        path = "/completion"
        body: dict[str, Any] = {"prompt": "p" * rng.randint(1, 60), "n_predict": 30}
    else:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "q" * rng.randint(1, 60)}]}
        body["max_tokens"] = 30
    body |= {"ignore_eos": True, "stream": stream, "return_progress": stream and rng.random() < 0.5}
    how = rng.choice(["cancel", "lines", "finish"] if stream else ["cancel", "finish"])
    task = asyncio.ensure_future(session.post(base + path, json=body))
    if how == "cancel":  # gone at any time: queued, prefilling, decoding, or before sending
        await asyncio.sleep(rng.random() * 0.1)
        task.cancel()
        try:
            resp = await task
        except asyncio.CancelledError:
            return how
        if stream:
            resp.close()
        else:
            await resp.read()
        return how
    resp = await task
    assert resp.status == 200, await resp.text()
    if how == "lines":
        for _ in range(rng.randint(1, 20)):
            if not await resp.content.readline():
                break
        resp.close()
    else:
        await resp.read()
    return how


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_200_clients_going_away_at_random_points_leave_nothing_behind(
    handler_cancellation: bool,
) -> None:
    engine = real_engine(parallel=4, max_queue=256, delay=0.001)
    server = TestServer(
        create_app(fake_service(engine=engine)), handler_cancellation=handler_cancellation
    )
    await server.start_server()
    rng = random.Random(12)
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            base = str(server.make_url(""))
            hows = await asyncio.gather(*(_client(session, base, rng) for _ in range(200)))
        assert {"cancel", "lines", "finish"} <= set(hows)
        await wait_idle(engine, timeout=30)
        assert not any(s["is_processing"] for s in engine.slots())
        assert engine.stats["queued"] == 0 and engine.stats["busy_slots"] == 0
        reg = engine.metrics.registry
        assert metric(reg, "mgserve_requests_rejected_total") == 0
        assert metric(reg, "mgserve_requests_total", finish_reason="abort")
        # and it still serves
        async with TestClient(server) as client:
            r = await client.post("/completion", json={"prompt": "a", "n_predict": 2})
            assert r.status == 200
    finally:
        await server.close()
