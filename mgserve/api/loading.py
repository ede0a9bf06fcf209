"""While the model loads: the port is already open and every path answers 503 with llama-server's
"Loading model" error body plus ``status: "loading"`` and the load's ``progress`` (0..1); the load
itself runs in a thread of its own, so the event loop answers meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from mgserve import progress

T = TypeVar("T")
RETRY_AFTER_S = 5  # what a 503 "loading" tells clients to wait before asking again


def loading_body(fraction: float) -> dict[str, object]:
    return {
        "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"},
        "status": "loading",
        "progress": round(fraction, 3),
    }


def loading_app(state: progress.Progress) -> web.Application:
    """The app the port serves until the model is ready: 503 loading on every path and method."""

    async def loading(request: web.Request) -> web.Response:
        return web.json_response(
            loading_body(state.fraction), status=503, headers={"Retry-After": str(RETRY_AFTER_S)}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", loading)
    return app


def load_in_thread(load: Callable[[], T], state: progress.Progress) -> asyncio.Future[T]:
    """``load()`` in a daemon thread (a signal during a load need not wait for it to end) with
    the progress hooks reporting to ``state``; its result or exception in the future."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():  # cancelled: the server stopped while loading
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            with progress.tracking(state):
                result = load()
            state.finish()
        except BaseException as e:  # handed to the loop, which ends the server with it
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server already ended
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="mgserve-load", daemon=True).start()
    return fut
