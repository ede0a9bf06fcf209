"""The aiohttp application: middlewares, routes, and the engine's lifetime in one cleanup_ctx."""

from __future__ import annotations

import gc
import hmac
from collections.abc import AsyncIterator

from aiohttp import web

from mgserve.api import (
    anthropic_routes,
    llama_routes,
    openai_routes,
    openapi,
    responses_routes,
    slot_routes,
)
from mgserve.api.errors import Handler, error_middleware, error_response, is_anthropic
from mgserve.api.http import SERVICE
from mgserve.api.service import Service

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # as llama-server: probes need no key


def _auth_middleware(api_key: str) -> web.middleware:  # type: ignore[valid-type]
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        # OpenAI clients send a Bearer token; llama-server and Anthropic clients X-Api-Key
        given = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
        if given.startswith("Bearer "):
            given = given[len("Bearer ") :]
        if not hmac.compare_digest(given.encode(), expected):
            return error_response("invalid API key", 401, anthropic=is_anthropic(request.path))
        return await handler(request)

    return auth


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[SERVICE].engine
    await engine.start()
    yield
    await engine.stop()


async def _text_pool_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[SERVICE].text.close()


def create_app(service: Service) -> web.Application:
    # What is loaded by now (the model, the tokenizer's tables) lives as long as the server: out
    # of the collector's sight, a full collection (which holds the GIL, on whichever thread
    # allocates) no longer walks it while a large prompt is tokenized beside the event loop.
    gc.freeze()
    middlewares = [error_middleware]
    if service.settings.api_key:
        middlewares.append(_auth_middleware(service.settings.api_key))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=service.settings.max_body_mb * 1024 * 1024,
    )
    app[SERVICE] = service
    app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.append(_text_pool_ctx)
    app.add_routes(openai_routes.ROUTES)
    app.add_routes(llama_routes.ROUTES)
    app.add_routes(anthropic_routes.ROUTES)
    app.add_routes(responses_routes.ROUTES)
    app.add_routes(slot_routes.ROUTES)
    app.add_routes(openapi.ROUTES)
    return app
