"""The app's typed keys, the request body as every route reads it and the JSON response every
route writes (orjson, not the stdlib)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from mgserve.api.errors import ApiError
from mgserve.api.fields import check_fields
from mgserve.api.service import Service

SERVICE = web.AppKey("service", Service)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def read_body(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The body as a JSON object of fields the route implements (``fields.py``); 400 for anything
    else (413 comes from aiohttp's size limit)."""
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as e:
        raise ApiError(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_fields(body, allowed)
    return body


async def body_size(request: web.Request) -> int:
    """The body's length in bytes: how much text work the request can ask for (textwork.py).
    aiohttp keeps the body read_body read, so this reads nothing again."""
    return len(await request.read())
