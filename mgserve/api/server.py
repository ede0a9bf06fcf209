"""``mgserve serve``: build the Service, run the app on uvloop, shut down gracefully on a signal."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from mgserve.api.app import create_app
from mgserve.api.drain import Drain
from mgserve.api.http import SERVICE
from mgserve.api.service import build_service
from mgserve.config import Settings

log = logging.getLogger("mgserve.api")

SHUTDOWN_TIMEOUT_S = 10.0  # how long in-flight requests get to finish after SIGTERM/SIGINT


async def run_until_signal(app: web.Application, host: str, port: int) -> None:
    # handler_cancellation: a client that disconnects cancels its handler, whose `finally`
    # aborts the request, so the slot frees even while the handler waits for a token
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("mgserve listening on http://%s:%d", host, port)
        stop, force = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal: stop without waiting
            loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())
        await stop.wait()
        await drain(runner, app[SERVICE].drain, force)
    finally:
        # aiohttp's order: stop listening, close idle connections, wait for handlers, then run
        # the cleanup contexts (the engine stops last)
        await runner.cleanup()


async def drain(runner: web.AppRunner, gens: Drain, force: asyncio.Event) -> None:
    """Stop listening (a new connection is refused), refuse new generations on open connections
    (503), give those in flight SHUTDOWN_TIMEOUT_S to finish, then end the rest with an error."""
    for site in list(runner.sites):
        await site.stop()
    gens.close()
    log.info("shutting down: %d generations in flight", len(gens.running()))
    cut = await gens.wait(SHUTDOWN_TIMEOUT_S, force)
    if cut:
        log.warning("shut down %d generations still running", cut)


def serve(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    service = build_service(settings)
    app = create_app(service)
    try:
        import uvloop

        uvloop.run(run_until_signal(app, settings.host, settings.port))
    except ImportError:  # uvloop has no Windows build
        asyncio.run(run_until_signal(app, settings.host, settings.port))
    return 0
