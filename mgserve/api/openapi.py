"""``GET /openapi.json``: an OpenAPI 3.1 description of the routes this server answers.

Made from what the server does, not written beside it: the paths and methods from the app's
router, and each POST route's request body from the field table its handler checks (fields.py),
as an object whose properties are exactly those fields (``additionalProperties: false``: any other
is refused with a 400 naming it). Field values are described loosely (any JSON): their checks
live in the handlers, which answer a bad value with a 400 naming the field. Every error is the
OpenAI-style body of errors.py. Tools such as schemathesis can fuzz the server from it; the
project's own fuzz (tests/api/test_fuzz.py) uses hypothesis on the same tables.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mgserve import __version__
from mgserve.api import fields

# POST path -> the fields its handler takes (the table it passes to read_body)
BODIES: dict[str, frozenset[str]] = {
    "/v1/chat/completions": fields.CHAT,
    "/chat/completions": fields.CHAT,
    "/v1/completions": fields.COMPLETIONS,
    "/completion": fields.LLAMA_COMPLETION,
    "/completions": fields.LLAMA_COMPLETION,
    "/infill": fields.INFILL,
    "/tokenize": fields.TOKENIZE,
    "/detokenize": fields.DETOKENIZE,
    "/apply-template": fields.APPLY_TEMPLATE,
    "/v1/messages": fields.ANTHROPIC_MESSAGES,
    "/v1/messages/count_tokens": fields.ANTHROPIC_COUNT_TOKENS,
    "/v1/responses": fields.RESPONSES,
    "/slots/{id_slot}": fields.SLOT_FILE,
}
# query parameters a route reads
QUERY: dict[str, dict[str, str]] = {
    "/slots/{id_slot}": {"action": "save, restore or erase"},
}
OPTIONAL_BODY = frozenset({"/slots/{id_slot}"})  # erase takes none
ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _responses() -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "200": {"description": "the answer (JSON, or an SSE stream where the request asks)"},
        "400": {"description": "a field or its value refused; the message names it", **err},
        "401": {"description": "no or a wrong API key (with --api-key)", **err},
        "503": {"description": "loading, draining, or the queue is full", **err},
    }


def _operation(method: str, path: str) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": f"{method} {path}", "responses": _responses()}
    params = [
        {"name": n, "in": "path", "required": True, "schema": {"type": "integer"}}
        for n in ("id_slot",)
        if "{" + n + "}" in path
    ]
    params += [
        {"name": n, "in": "query", "required": True, "description": d, "schema": {"type": "string"}}
        for n, d in QUERY.get(path, {}).items()
    ]
    if params:
        op["parameters"] = params
    if method == "post":
        props: dict[str, Any] = {name: {} for name in sorted(BODIES[path])}
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        op["requestBody"] = {
            "required": path not in OPTIONAL_BODY,
            "content": {"application/json": {"schema": schema}},
        }
    return op


def describe(app: web.Application) -> dict[str, Any]:
    """The document for ``app``'s routes (KeyError: a POST route with no entry in BODIES)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        method = route.method.lower()
        path = route.resource.canonical if route.resource is not None else ""
        if method in ("get", "post") and path:
            paths.setdefault(path, {})[method] = _operation(method, path)
    return {
        "openapi": "3.1.0",
        "info": {"title": "mgserve", "version": __version__},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": {"Error": ERROR}},
    }


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(describe(request.app))


ROUTES = [web.get("/openapi.json", openapi)]
