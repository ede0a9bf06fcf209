"""Faults that need the real process, on the default built-in model (slow: minutes on CPU):
SIGTERM under load (in-flight requests finish or end with a clean error, the port closes at once,
nothing new is admitted, the process exits 0 within the shutdown timeout), and a restart that
restores a saved slot (--slot-save-path) whose next request reuses the cache."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mgserve.api.server import SHUTDOWN_TIMEOUT_S
from tests.api.serve_process import ServeProcess
from tests.api.test_admission import sse_events

pytestmark = pytest.mark.slow
ARGS = ["-c", "512", "-np", "2", "-t", "1", "--log-level", "info"]


async def test_sigterm_under_load(tmp_path: Path) -> None:
    server = ServeProcess(ARGS, tmp_path / "serve.log")
    try:
        server.wait_ready()
        base = server.base
        async with aiohttp.ClientSession() as session:

            def post(body: dict[str, Any]) -> asyncio.Future[aiohttp.ClientResponse]:
                return asyncio.ensure_future(session.post(base + "/completion", json=body))

            long_body = {"prompt": "Count:", "n_predict": 480, "ignore_eos": True}
            short = await session.post(
                base + "/completion", json={"prompt": "Hi", "n_predict": 12, "stream": True}
            )
            streamed = await session.post(base + "/completion", json=long_body | {"stream": True})
            await streamed.content.readline()  # both slots generate
            queued = post(long_body)  # waits for a slot
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            server.terminate()
            await asyncio.sleep(0.5)
            with pytest.raises(aiohttp.ClientConnectionError):  # the port closed at once
                await session.post(base + "/completion", json={"prompt": "x", "n_predict": 1})
            events = await sse_events(short)  # finished within the timeout
            assert events[-1]["stop"] and events[-1]["tokens_predicted"] == 12
            events = await sse_events(streamed)  # cut at the timeout: an error event ends it
            assert "shutting down" in events[-1]["error"]["message"], events[-1]
            assert all("content" in e for e in events[:-1])
            r = await queued
            assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
        code = await asyncio.to_thread(server.proc.wait, SHUTDOWN_TIMEOUT_S + 20)
        took = time.monotonic() - t0
        assert code == 0, server.output()
        assert SHUTDOWN_TIMEOUT_S - 1 < took < SHUTDOWN_TIMEOUT_S + 20, took
        assert "shutting down: 3 generations in flight" in server.output()
    finally:
        server.stop()


async def _complete(session: aiohttp.ClientSession, base: str, prompt: str) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "id_slot": 0}
    r = await session.post(base + "/completion", json=body)
    assert r.status == 200, await r.text()
    return await r.json()  # type: ignore[no-any-return]


async def test_restart_restores_a_saved_slot(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    args = ["-c", "512", "-np", "1", "-t", "1", "--slot-save-path", str(slots)]
    prompt = "The history of the printing press begins " * 8
    server = ServeProcess(args, tmp_path / "first.log")
    try:
        server.wait_ready()
        async with aiohttp.ClientSession() as session:
            first = await _complete(session, server.base, prompt)
            r = await session.post(server.base + "/slots/0?action=save", json={"filename": "a.bin"})
            saved = await r.json()
            assert r.status == 200 and saved["n_saved"] > 0, saved
        assert server.stop() == 0
    finally:
        server.stop()
    server = ServeProcess(args, tmp_path / "second.log")
    try:
        server.wait_ready()
        async with aiohttp.ClientSession() as session:
            r = await session.post(
                server.base + "/slots/0?action=restore", json={"filename": "a.bin"}
            )
            restored = await r.json()
            assert r.status == 200 and restored["n_restored"] == saved["n_saved"], restored
            again = await _complete(session, server.base, prompt)
        # every prompt token but the last (whose logits the answer needs) came from the file
        n_prompt = first["timings"]["prompt_n"]
        assert saved["n_saved"] == n_prompt + 3  # and the answer's tokens fed back
        assert again["timings"]["cache_n"] == n_prompt - 1
        assert again["timings"]["prompt_n"] == 1
        assert again["content"] == first["content"]
    finally:
        server.stop()
