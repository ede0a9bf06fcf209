"""A client that goes away mid-generation frees its slot."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from mgserve.api.app import create_app
from mgserve.api.http import SERVICE
from tests.api.conftest import fake_service
from tests.api.fakes import FakeEngine

LONG = {"prompt": "x", "n_predict": 200, "ignore_eos": True}


async def wait_idle(engine: FakeEngine, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while engine.busy() or engine.waiting:
        assert loop.time() < end, f"slots still busy: {engine.slots()}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("handler_cancellation", [False, True])
@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_frees_the_slot(stream: bool, handler_cancellation: bool) -> None:
    service = fake_service(reply=b"", step_s=0.02)
    engine: FakeEngine = service.engine  # type: ignore[assignment]
    server = TestServer(create_app(service), handler_cancellation=handler_cancellation)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            url = str(server.make_url("/completion"))
            if stream:
                resp = await session.post(url, json=LONG | {"stream": True})
                await resp.content.readline()  # the first event arrived: generation is running
                assert engine.busy() == 1
                resp.close()  # drop the connection
            else:
                task = asyncio.create_task(session.post(url, json=LONG))
                while not engine.busy():
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_idle(engine)
            assert engine.n_aborted == 1
            assert len(engine.submitted) == 1
            # the freed slot serves the next request
            r = await session.post(url, json={"prompt": "x", "n_predict": 3, "ignore_eos": True})
            assert (await r.json())["content"] == "..."
            assert server.app is not None and server.app[SERVICE] is service
    finally:
        await server.close()


async def test_stop_string_aborts_the_request(client: Any) -> None:
    engine: FakeEngine = client.server.app[SERVICE].engine
    r = await (await client.post("/completion", json={"prompt": "x", "stop": ["ll"]})).json()
    assert r["content"] == "He"
    await wait_idle(engine)
    assert engine.n_aborted == 1  # the engine was told, so the slot did not run on
    assert engine.abort_reasons == ["stop"]  # as a stop: the metrics count no cancellation


async def test_concurrent_requests_queue_beyond_the_slots(client: Any) -> None:
    bodies = [{"prompt": "x", "n_predict": 5 + i} for i in range(5)]
    rs = await asyncio.gather(*(client.post("/completion", json=b) for b in bodies))
    contents = [(await r.json())["content"] for r in rs]
    assert contents == ["Hello, world!"[: 5 + i] for i in range(5)]
