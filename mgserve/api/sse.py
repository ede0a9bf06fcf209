"""Server-sent events: one ``data: {json}\\n\\n`` per message, written as generation proceeds.

``stream`` is the one loop every dialect runs: each says only what its events look like.
Anthropic's and the Responses API's events are also named (``event: <its type>`` before the data
line), as their clients dispatch on the name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from mgserve.api.choices import Choices
from mgserve.api.errors import error_body
from mgserve.api.generate import Chunk, Generation

# a client that went away shows up as one of these on write (aiohttp wraps the reset in its own)
DISCONNECTED = (ConnectionResetError, ConnectionError)


async def _open(request: web.Request) -> web.StreamResponse:
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


async def _send(resp: web.StreamResponse, obj: Any, named: bool) -> None:
    head = b"event: " + obj["type"].encode() + b"\n" if named else b""
    await resp.write(head + b"data: " + orjson.dumps(obj) + b"\n\n")


async def stream(
    request: web.Request,
    gen: Generation | Choices,  # Choices: n choices, their chunks interleaved (Chunk.index)
    # the events of a chunk that carries text, tokens or (return_progress) prompt progress
    chunk: Callable[[Chunk], Sequence[Any]],
    closing: Callable[[Chunk], Sequence[Any]],  # the events after a choice's last chunk's own
    *,
    opening: Sequence[Any] = (),  # events before any token (OpenAI chat: the role)
    ending: Callable[[], Sequence[Any]] = lambda: (),  # after every choice closed (usage)
    done: bool = False,  # end with ``data: [DONE]`` (OpenAI)
    named: bool = False,  # named events (Anthropic's, the Responses API's)
    failed: Callable[[str], Sequence[Any]] | None = None,  # a failure's events; else an error
) -> web.StreamResponse:
    """Stream ``gen`` to the client. A failure after the 200 went out travels as the stream's last
    events (``failed``'s, else an error in OpenAI's shape, or Anthropic's when ``named``); a
    client that goes away ends the loop (the caller's ``with gen`` aborts the request)."""
    resp = await _open(request)
    try:
        for obj in opening:
            await _send(resp, obj, named)
        async for c in gen.chunks():
            if c.finish_reason == "error":
                error = [error_body(gen.failure, 500, anthropic=named)]
                for obj in failed(gen.failure) if failed else error:
                    await _send(resp, obj, named)
                return resp
            if c.text or c.tokens or c.progress:
                for obj in chunk(c):
                    await _send(resp, obj, named)
            if c.finish_reason is not None:
                for obj in closing(c):
                    await _send(resp, obj, named)
        for obj in ending():
            await _send(resp, obj, named)
        if done:
            await resp.write(b"data: [DONE]\n\n")
    except DISCONNECTED:
        pass
    return resp
