"""The port opens before the model is loaded: /health and every other path answer 503 "loading"
with a growing progress fraction, then the real app answers; a load that fails ends the server
with its message and a non-zero status (issue 15)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest

from mgserve import progress
from mgserve.api.server import listen, serve_async
from mgserve.config import Settings
from tests.api.conftest import fake_service

ROOT = Path(__file__).resolve().parents[2]


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with session.get(url) as r:
        return r.status, await r.json()


async def test_health_says_loading_with_growing_progress_then_ok() -> None:
    gate = threading.Event()  # the test lets the load go on, tensor by tensor
    loaded = threading.Event()

    def slow_load():  # a fake loader that reads 10 "tensors" as the real ones report them
        for i in range(10):
            gate.wait(5)
            gate.clear()
            progress.tensor_read(f"blk.{i}.weight", 10)
        loaded.set()
        return fake_service()

    socks = listen("127.0.0.1", 0)
    port = socks[0].getsockname()[1]
    stop = asyncio.Event()
    server = asyncio.create_task(
        serve_async(Settings(), load=slow_load, stop=stop, socks=socks, state=progress.Progress())
    )
    base = f"http://127.0.0.1:{port}"
    seen: list[float] = []
    try:
        async with aiohttp.ClientSession() as s:
            for round_ in range(4):
                status, body = await _get(s, base + "/health")
                assert status == 503
                assert body["status"] == "loading"
                assert body["error"] == {
                    "code": 503,
                    "message": "Loading model",
                    "type": "unavailable_error",
                }
                seen.append(body["progress"])
                for _ in range(3 if round_ < 3 else 0):  # three tensors more (9 of 10 in all)
                    gate.set()
                    while gate.is_set():
                        await asyncio.sleep(0.005)
                await asyncio.sleep(0.01)
            async with s.post(base + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 503  # the last tensor is not read yet
            gate.set()
            assert loaded.wait(5)
            for _ in range(200):
                status, body = await _get(s, base + "/health")
                if status == 200:
                    break
                await asyncio.sleep(0.02)
            assert (status, body) == (200, {"status": "ok"})
            async with s.get(base + "/v1/models") as r:  # the real app's routes
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == "fake-model"
    finally:
        stop.set()
        assert await asyncio.wait_for(server, 10) == 0
    # weights fill 0..0.9 of the fraction: 0, 3, 6 and 9 tensors of 10
    assert seen == [0.0, 0.27, 0.54, 0.81], seen
    with pytest.raises(OSError):  # the port is closed after shutdown
        socket.create_connection(("127.0.0.1", port), timeout=1)


async def test_every_path_answers_503_loading_while_loading() -> None:
    release = threading.Event()

    def blocked_load():
        release.wait(10)
        return fake_service()

    socks = listen("127.0.0.1", 0)
    port = socks[0].getsockname()[1]
    stop = asyncio.Event()
    server = asyncio.create_task(
        serve_async(
            Settings(), load=blocked_load, stop=stop, socks=socks, state=progress.Progress()
        )
    )
    try:
        async with aiohttp.ClientSession() as s:
            for method, path in [("POST", "/v1/chat/completions"), ("GET", "/slots"),
                                 ("POST", "/completion"), ("GET", "/nothing/here")]:  # fmt: skip
                async with s.request(method, f"http://127.0.0.1:{port}{path}", json={}) as r:
                    assert r.status == 503, path
                    assert r.headers["Retry-After"]
                    assert (await r.json())["status"] == "loading"
    finally:
        stop.set()  # stopped while loading: a clean exit, the thread is left to the process
        assert await asyncio.wait_for(server, 10) == 0
        release.set()


async def test_a_load_that_raises_ends_the_server_with_status_1(caplog) -> None:
    def broken_load():
        raise RuntimeError("the GPU fell off")

    socks = listen("127.0.0.1", 0)
    rc = await asyncio.wait_for(
        serve_async(
            Settings(),
            load=broken_load,
            stop=asyncio.Event(),
            socks=socks,
            state=progress.Progress(),
        ),  # fmt: skip
        10,
    )
    assert rc == 1
    assert "loading the model failed: RuntimeError: the GPU fell off" in caplog.text


def test_mgserve_serve_with_a_missing_model_exits_non_zero_with_the_message(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    missing = tmp_path / "missing.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgserve",
            "serve",
            "-m",
            str(missing),
            "--port",
            str(port),
            "--device",
            "cpu",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode != 0
    assert "mgserve: error:" in proc.stderr and "missing.gguf" in proc.stderr, proc.stderr
