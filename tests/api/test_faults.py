"""Faults, in process over the real engine on the fake model (fast): clients that drop the
connection at random points of the HTTP exchange (hundreds, on raw sockets: mid-headers, mid-body,
queued, mid-stream, on every generating route), a client that reads its stream very slowly beside
others, and graceful shutdown (server.drain): new connections refused, new generations 503, those
in flight finished or ended with a clean error. test_faults_process.py runs `mgserve serve` itself:
SIGTERM under load and a restart that restores a saved slot."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mgserve.api import server
from mgserve.api.app import create_app
from mgserve.api.service import Service
from tests.api.conftest import fake_service
from tests.api.test_admission import real_engine, sse_events, wait_idle

MSG = [{"role": "user", "content": "hi"}]
# every generating route, streamed, long enough to be caught mid-way
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/completion", {"prompt": "p", "n_predict": 40}),
    ("/v1/completions", {"prompt": "p", "max_tokens": 40}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 40}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 40, "n": 2}),
    ("/v1/messages", {"messages": MSG, "max_tokens": 40}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 40}),
]
STILL = {"prompt": "a", "n_predict": 3, "ignore_eos": True}  # still served afterwards
WHERE = ("headers", "body", "sent", "first", "mid")


async def _raw_client(port: int, rng: random.Random) -> str:
    """One request on a raw socket, dropped at a random point of the exchange."""
    path, body = rng.choice(ROUTES)
    data = orjson.dumps(body | {"stream": rng.random() < 0.7, "ignore_eos": True})
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    where = rng.choice(WHERE)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if where == "headers":
            writer.write(head[: rng.randrange(1, len(head))])
        elif where == "body":
            writer.write(head + data[: rng.randrange(0, len(data))])
        else:
            writer.write(head + data)
        await writer.drain()
        if where == "sent":  # queued, prefilling or decoding: gone before any answer is read
            await asyncio.sleep(rng.random() * 0.05)
        elif where in ("first", "mid"):
            await reader.readuntil(b"\r\n\r\n")
            for _ in range(1 if where == "first" else rng.randint(2, 30)):
                try:  # what has come, up to n bytes (a whole answer kept alive: nothing more)
                    if not await asyncio.wait_for(reader.read(rng.randint(1, 400)), 1.0):
                        break
                except TimeoutError:
                    break
    finally:
        writer.transport.abort()  # a reset, as a client that dies
    return where


async def _check_clean(service: Service, base: str) -> None:
    engine = service.engine
    await wait_idle(engine)  # type: ignore[arg-type]
    assert not any(s["is_processing"] for s in engine.slots())
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while service.drain.running():  # a handler waiting on a dead socket notices it
        assert loop.time() < end, "a generation's handler is still open"
        await asyncio.sleep(0.02)
    async with aiohttp.ClientSession() as session:
        r = await session.post(base + "/completion", json=STILL)
        assert r.status == 200 and (await r.json())["tokens_predicted"] == 3


@pytest.mark.parametrize("handler_cancellation", [True, False])
async def test_400_raw_clients_dropping_at_random_points(handler_cancellation: bool) -> None:
    service = fake_service(engine=real_engine(parallel=2, max_queue=512, delay=0.001))
    srv = TestServer(create_app(service), handler_cancellation=handler_cancellation)
    await srv.start_server()
    rng = random.Random(15)
    try:
        for _ in range(4):  # in waves of 100 at once: beyond the 2 slots, most queue
            wheres = await asyncio.gather(*(_raw_client(srv.port, rng) for _ in range(100)))  # type: ignore[arg-type]
            assert set(wheres) == set(WHERE)
            await _check_clean(service, str(srv.make_url("")))
        reg = service.engine.metrics.registry
        from tests.prom import metric

        assert metric(reg, "mgserve_requests_total", finish_reason="abort")
        assert not metric(reg, "mgserve_requests_total", finish_reason="error")
    finally:
        await srv.close()


async def _tokens_per_s(session: aiohttp.ClientSession, url: str, n: int) -> float:
    body = {"prompt": "x", "n_predict": n, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    resp = await session.post(url, json=body)
    events = await sse_events(resp)
    assert events[-1]["stop"] and events[-1]["tokens_predicted"] == n
    return n / (time.perf_counter() - t0)


async def test_a_slow_reader_does_not_slow_the_others() -> None:
    """A client that reads one chunk a second, with a receive buffer too small to hold its
    stream: its handler waits on the socket, the engine does not (the request's events queue,
    at most max_tokens of them), and the others stream as fast as without it."""
    engine = real_engine(parallel=4, max_queue=16, delay=0.005)
    service = fake_service(engine=engine)
    # small socket buffers on both sides (accepted sockets inherit the listener's): the slow
    # client's stream cannot hide in the kernel's, as it would in loopback's 4 MB
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    runner = web.AppRunner(create_app(service), handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, listener).start()
    port = listener.getsockname()[1]
    url = f"http://127.0.0.1:{port}/completion"
    try:
        async with aiohttp.ClientSession() as session:
            alone = await _tokens_per_s(session, url, 60)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.connect(("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock)
            # big events: 100 top logprobs a token, about 10 KB each, 200 of them
            body = orjson.dumps(
                {
                    "prompt": "x",
                    "n_predict": 200,
                    "ignore_eos": True,
                    "stream": True,
                    "n_probs": 100,
                }
            )
            writer.write(
                b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")

            async def slow() -> None:
                for _ in range(4):
                    await reader.readline()
                    await asyncio.sleep(1.0)

            slow_task = asyncio.create_task(slow())
            others = await asyncio.gather(*(_tokens_per_s(session, url, 60) for _ in range(3)))
            # the engine finished the slow request while its client had read almost nothing
            t_end = asyncio.get_running_loop().time() + 10
            while engine._sched.n_busy:
                assert asyncio.get_running_loop().time() < t_end, engine.slots()
                await asyncio.sleep(0.05)
            assert not slow_task.done()
            # and its handler still waits to write the stream out: the server holds it back
            # (at most its max_tokens events), the socket sets the pace
            assert len(service.drain.running()) == 1
            await slow_task
            writer.transport.abort()
        # four sessions share a step where one ran alone: a step costs about the same (the fake
        # model's delay is per step), so each still gets well over half the lone rate
        assert min(others) > 0.5 * alone, (others, alone)
        await _check_clean(service, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


async def _start(service: Service) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(create_app(service), handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def test_shutdown_drains_then_ends_what_is_left_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "SHUTDOWN_TIMEOUT_S", 1.0)
    service = fake_service(engine=real_engine(parallel=2, max_queue=8, delay=0.01))
    runner, port = await _start(service)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            short = asyncio.ensure_future(
                session.post(
                    base + "/completion", json={"prompt": "a", "n_predict": 20, "ignore_eos": True}
                )
            )
            long_stream = await session.post(
                base + "/v1/chat/completions",
                json={"messages": MSG, "max_tokens": 250, "ignore_eos": True, "stream": True},
            )
            await long_stream.content.readline()  # generating
            long_plain = asyncio.ensure_future(
                session.post(
                    base + "/completion", json={"prompt": "a", "n_predict": 250, "ignore_eos": True}
                )
            )
            await asyncio.sleep(0.05)
            # a kept-alive connection the shutdown does not close: a new generation on it is a 503
            keep_r, keep_w = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.perf_counter()
            drain = asyncio.create_task(server.drain(runner, service.drain, asyncio.Event()))
            await asyncio.sleep(0.1)
            with pytest.raises(OSError):  # the port is closed
                await asyncio.open_connection("127.0.0.1", port)
            body = b'{"prompt": "b", "n_predict": 2}'
            keep_w.write(
                b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            status = await keep_r.readline()
            assert b" 503 " in status, status
            head = await keep_r.readuntil(b"\r\n\r\n")
            assert b"Retry-After" in head
            keep_w.close()
            r = await short  # finished within the timeout
            assert r.status == 200 and (await r.json())["tokens_predicted"] == 20
            r = await long_plain  # still running at the timeout: a 503 naming the shutdown
            assert r.status == 503, await r.text()
            assert "shutting down" in (await r.json())["error"]["message"]
            events = await sse_events(long_stream)  # the stream ends with an error event
            assert "shutting down" in events[-1]["error"]["message"]
            await drain
            assert 1.0 <= time.perf_counter() - t0 < 3.0
    finally:
        await runner.cleanup()
    assert not service.drain.running()


async def test_shutdown_with_nothing_in_flight_is_immediate() -> None:
    service = fake_service(engine=real_engine())
    runner, port = await _start(service)
    try:
        t0 = time.perf_counter()
        await server.drain(runner, service.drain, asyncio.Event())
        assert time.perf_counter() - t0 < 0.5
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        await runner.cleanup()


async def test_health_says_shutting_down_once_the_drain_began() -> None:
    service = fake_service(engine=real_engine())
    srv = TestServer(create_app(service))
    await srv.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(srv.make_url("/health")) as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            service.drain.close()  # what server.drain does after the sites stop
            async with http.get(srv.make_url("/health")) as r:
                assert r.status == 503 and (await r.json())["status"] == "shutting down"
    finally:
        await srv.close()
