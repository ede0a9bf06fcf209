"""Server-sent events: one ``data: {json}\\n\\n`` per message, written as generation proceeds."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from mgserve.api.errors import error_body

# a client that went away shows up as one of these on write (aiohttp wraps the reset in its own)
DISCONNECTED = (ConnectionResetError, ConnectionError)


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer a token stream
        },
    )
    await resp.prepare(request)
    return resp


async def send(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")


async def send_error(resp: web.StreamResponse, message: str) -> None:
    """A failure after the 200 went out: the error travels as the stream's last event."""
    await send(resp, error_body(message, 500))


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
