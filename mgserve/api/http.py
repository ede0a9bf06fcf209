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
DEPTH_MAX = 128  # what a request body may nest (the body itself is level 1; orjson stops at 1024)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def read_body(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The body as a JSON object of fields the route implements (``fields.py``); 400 for anything
    else (413 comes from aiohttp's size limit)."""
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as e:
        raise ApiError(f"malformed JSON body: {_why(raw, e)}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_fields(body, allowed)
    _check_depth(body)
    return body


def _check_depth(body: dict[str, Any]) -> None:
    """400 naming the field whose value nests arrays and objects more than DEPTH_MAX deep: the
    template, the grammar compiler and the tool-call parsers recurse, and a body orjson reads
    (up to 1024 levels) would otherwise end in a RecursionError there."""
    for field, value in body.items():
        if (type(value) is dict or type(value) is list) and _deeper(value, 2):
            raise ApiError(
                f"'{field}' nests arrays and objects deeper than {DEPTH_MAX} levels", param=field
            )


def _deeper(value: dict[str, Any] | list[Any], depth: int) -> bool:
    """Whether ``value`` (at ``depth``) holds a container deeper than DEPTH_MAX; recursion stays
    within DEPTH_MAX frames, and a million small lists take about 0.25 s."""
    for c in value.values() if type(value) is dict else value:
        if type(c) is dict or type(c) is list:
            if depth >= DEPTH_MAX or _deeper(c, depth + 1):
                return True
    return False


async def body_size(request: web.Request) -> int:
    """The body's length in bytes: how much text work the request can ask for (textwork.py).
    aiohttp keeps the body read_body read, so this reads nothing again."""
    return len(await request.read())


def _why(raw: bytes, e: orjson.JSONDecodeError) -> str:
    """What is wrong with a body orjson refused, in the client's terms: orjson says "surrogates
    not allowed" of any invalid UTF-8 and "depth limit exceeded" of deep nesting."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        bad = raw[u.start : u.end]
        return f"invalid UTF-8 at byte offset {u.start} (0x{bad.hex()}: {u.reason})"
    if "depth limit" in e.msg:
        return f"arrays and objects nested deeper than {DEPTH_MAX} levels (byte offset {e.pos})"
    return str(e)
