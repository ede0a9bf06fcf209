"""200 streaming clients on a real hybrid model (the tiny converted qwen3next, with checkpoints in
device and host memory), going away at random points: before their first token, right after it,
mid-stream, ended by a stop string, or reading to max_tokens; /metrics scraped all along by two
scrapers. After each round: no slot busy, nothing queued, the checkpoint book within its policy
and the runner holding exactly what it counts, the metrics' requests all accounted for
(submitted = finished + cancelled), and the second round's memory where the first left it."""

from __future__ import annotations

import asyncio
import gc
import random
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from mgserve.api.app import create_app
from mgserve.api.service import build_service
from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from tests.api.test_admission import wait_idle
from tests.prom import Samples, metric, samples

FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen3next.gguf"
SETTINGS = Settings(
    model=str(FILE),
    ctx_size=128,
    parallel=4,
    device="cpu",
    threads=1,
    batch_size=16,
    checkpoint_every=32,
    ctx_checkpoints=2,  # a third checkpoint of a slot moves one to host memory
    cache_ram=1,  # MiB: room for about 60 of this model's 16.5 KB checkpoints
    max_queue=256,
)
N_CLIENTS = 200
SYSTEMS = [[10 + (31 * k + 7 * i) % 180 for i in range(20 + 10 * k)] for k in range(4)]
HOWS = ("early", "first", "mid", "stop", "length")
REASONS = ("stop", "length", "abort", "error")
PHASES = ("prefill", "decode", "mixed")
RSS_GROWTH_MAX = 24 << 20  # bytes the second round may add to what the first left


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def _client(
    session: aiohttp.ClientSession, url: str, rng: random.Random, stops: list[str]
) -> str:
    """One client; returns how it ended."""
    k = rng.randrange(len(SYSTEMS))
    how = rng.choice(HOWS)
    body: dict[str, Any] = {"stream": True, "ignore_eos": True, "temperature": 0}
    if how == "stop":  # the probe's prompt, greedy: its answer holds the stop string
        body |= {"prompt": SYSTEMS[k], "n_predict": 8, "stop": [stops[k]]}
    else:
        tail = [rng.randrange(10, 300) for _ in range(rng.randint(1, 30))]
        body |= {"prompt": SYSTEMS[k] + tail, "n_predict": rng.randint(1, 8)}
    task = asyncio.ensure_future(session.post(url, json=body))
    if how == "early":  # queued, prefilling, or not even sent
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        try:
            (await task).close()
        except asyncio.CancelledError:
            pass
        return how
    resp = await task
    assert resp.status == 200, await resp.text()
    if how in ("first", "mid"):
        for _ in range(1 if how == "first" else rng.randint(2, 5)):
            await resp.content.readline()
        resp.close()
        return how
    last = None
    async for line in resp.content:
        if line.startswith(b"data: "):
            last = orjson.loads(line[6:])
    assert last is not None and last["stop"]
    return f"{how}:{last['stop_type']}"


async def _scraper(session: aiohttp.ClientSession, url: str, done: asyncio.Event) -> float:
    """Scrapes /metrics until ``done``: counters never go back, requests are all accounted.
    Returns the most checkpoint bytes seen in host memory."""
    names = ["llamacpp:prompt_tokens_total", "llamacpp:n_decode_total"]
    last = dict.fromkeys(names, 0.0)
    host = 0.0
    while not done.is_set():
        text = samples(await (await session.get(url)).text())
        for name in names:
            v = metric(text, name)
            assert v is not None and v >= last[name]
            last[name] = v
        open_ = metric(text, "mgserve_requests_submitted_total") - _finished(text)  # type: ignore[operator]
        busy = metric(text, "llamacpp:requests_processing")
        assert open_ >= busy + metric(text, "llamacpp:requests_deferred")  # type: ignore[operator]
        host = max(host, metric(text, "mgserve_checkpoint_host_bytes") or 0)
        await asyncio.sleep(0.02)
    return host


def _finished(text: str | Samples) -> float:
    return sum(metric(text, "mgserve_requests_total", finish_reason=r) or 0 for r in REASONS)


def _check_book(engine: Engine) -> None:
    """The book within its policy, the runner holding exactly what it counts."""
    book = engine._sched.checkpoints
    held = book.held
    assert held, "the round took no checkpoint"
    for slot in engine.slots():
        device = [c for c in slot["checkpoints"] if c["memory"] == "device"]
        assert len(device) <= SETTINGS.ctx_checkpoints
        assert all(c["pos"] <= slot["n_past"] for c in slot["checkpoints"])
    assert book.nbytes_in(host=True) <= SETTINGS.cache_ram << 20
    store = engine._runner.checkpoints  # type: ignore[attr-defined]
    assert set(store.held) == set(held)


@pytest.mark.slow
async def test_200_clients_going_away_leave_no_slot_no_checkpoint_no_memory_behind() -> None:
    service = build_service(SETTINGS)
    engine: Engine = service.engine  # type: ignore[assignment]
    server = TestServer(create_app(service), handler_cancellation=True)  # as `mgserve serve`
    await server.start_server()
    rng = random.Random(7)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            url = str(server.make_url("/completion"))
            stops = []
            for system in SYSTEMS:  # a character of each greedy answer
                body = {"prompt": system, "n_predict": 8, "temperature": 0, "ignore_eos": True}
                text = (await (await session.post(url, json=body)).json())["content"]
                stops.append(next(c for c in text[2:] if c.isascii() and c.isprintable()))
            rss, host = [], 0.0
            for _ in range(2):
                done = asyncio.Event()
                metrics_url = str(server.make_url("/metrics"))
                scrapers = asyncio.gather(*(_scraper(session, metrics_url, done) for _ in "ab"))
                clients = [_client(session, url, rng, stops) for _ in range(N_CLIENTS)]
                hows = await asyncio.gather(*clients)
                await wait_idle(engine, timeout=20)
                done.set()
                host = max(host, *await scrapers)
                assert {h.split(":")[0] for h in hows} == set(HOWS)
                assert "stop:word" in hows and "length:limit" in hows
                _check_book(engine)
                gc.collect()
                rss.append(_rss())
            text = await (await session.get(str(server.make_url("/metrics")))).text()
            slots = await (await session.get(str(server.make_url("/slots")))).json()
    finally:
        await server.close()
    assert not any(s["is_processing"] for s in slots)
    assert {s["state"] for s in slots} == {"idle"}
    assert metric(text, "llamacpp:requests_processing") == 0
    assert metric(text, "llamacpp:requests_deferred") == 0
    assert metric(text, "mgserve_requests_rejected_total") == 0
    assert metric(text, "mgserve_requests_total", finish_reason="error") == 0
    assert metric(text, "mgserve_requests_submitted_total") == _finished(text)
    assert metric(text, "mgserve_requests_total", finish_reason="abort")  # some went away
    assert metric(text, "mgserve_requests_total", finish_reason="stop")  # stop strings
    assert metric(text, "mgserve_prompt_cache_hits_total")  # the shared system prompts
    assert host > 0  # checkpoints went through host memory
    steps = sum(metric(text, "mgserve_step_seconds_count", phase=p) or 0 for p in PHASES)
    assert steps == metric(text, "llamacpp:n_decode_total")
    assert metric(text, "mgserve_step_seconds_count", phase="mixed")  # prefill beside decode
    assert rss[1] - rss[0] < RSS_GROWTH_MAX, f"RSS {rss[0] >> 20} -> {rss[1] >> 20} MiB"
