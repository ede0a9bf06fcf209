"""The app's typed keys and the JSON response every route uses (orjson, not the stdlib)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from mgserve.api.service import Service

SERVICE = web.AppKey("service", Service)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")
