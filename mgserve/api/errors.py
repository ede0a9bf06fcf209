"""Errors in OpenAI's (or, on Anthropic's routes, Anthropic's) shape, and the middleware that
turns every failure into one.

Whatever goes wrong in a handler, the client gets ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx/5xx status and the server keeps serving; a trace goes to the log, never to
the client. Under ``/v1/messages`` the same error goes as ``{"type": "error", "error": {"type",
"message"}}``, the shape the ``anthropic`` client reads.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger("mgserve.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"  # this path and those under it are Anthropic's


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and the offending field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | int | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds: sent as Retry-After (a 503 when busy)


def error_body(
    message: str,
    status: int,
    param: str | None = None,
    code: str | int | None = None,
    anthropic: bool = False,
) -> dict[str, object]:
    if anthropic:  # Anthropic's shape has no param: the messages name the field
        default = "api_error" if status >= 500 else "invalid_request_error"
        kind = _ANTHROPIC_TYPES.get(status, default)
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | int | None = None,
    anthropic: bool = False,
    retry_after: int | None = None,
) -> web.Response:
    return web.Response(
        body=orjson.dumps(error_body(message, status, param, code, anthropic)),
        status=status,
        content_type="application/json",
        headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    anthropic = is_anthropic(request.path)
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.message, e.status, e.param, e.code, anthropic, e.retry_after)
    except ValueError as e:  # user input the core rejected (template, tokenizer)
        return error_response(str(e), 400, anthropic=anthropic)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(f"request body too large ({e.text})", 413, anthropic=anthropic)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        reason = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} not allowed on {request.path}",
        }
        resp = error_response(reason.get(e.status, e.reason), e.status, anthropic=anthropic)
        if "Allow" in e.headers:  # 405 says which methods the route takes
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response("internal server error", 500, anthropic=anthropic)
