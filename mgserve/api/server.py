"""``mgserve serve``: open the port at once (503 "loading" with a progress fraction while the model
loads in a thread: ``loading.py``), then serve the app on uvloop; shut down gracefully on a signal.
A load that fails ends the process with its message and a non-zero status."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from mgserve import progress
from mgserve.api.drain import Drain
from mgserve.api.loading import load_in_thread, loading_app
from mgserve.config import Settings

if TYPE_CHECKING:  # imported by the loading thread: the port opens before torch is imported
    from mgserve.api.service import Service

log = logging.getLogger("mgserve.api")

SHUTDOWN_TIMEOUT_S = 10.0  # how long in-flight requests get to finish after SIGTERM/SIGINT


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host:port`` (one per address it resolves to), bound now."""
    socks: list[socket.socket] = []
    seen = set()
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(128)
            s.setblocking(False)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


async def _serve_on(runner: web.AppRunner, socks: list[socket.socket]) -> None:
    # each site gets its own descriptor of the same listening socket: stopping one site (the
    # loading app's) closes only its descriptor, and the port never closes between the two apps
    for s in socks:
        await web.SockSite(runner, s.dup()).start()


async def _first(load: asyncio.Future[Service], stop: asyncio.Event) -> Service | None:
    """The loaded Service, or None when ``stop`` came first."""
    stopped: asyncio.Future[object] = asyncio.ensure_future(stop.wait())
    await asyncio.wait((load, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not load.done():
        load.cancel()
        return None
    return load.result()  # raises the load's error


async def serve_async(
    settings: Settings,
    load: Callable[[], Service] | None = None,
    stop: asyncio.Event | None = None,
    socks: list[socket.socket] | None = None,
    state: progress.Progress | None = None,
) -> int:
    """Serve until ``stop`` is set (default: SIGINT or SIGTERM). ``load`` builds the Service
    (default: ``build_service(settings)``); tests pass a fake, their own sockets and a stop."""
    load = load or (lambda: _build(settings))
    force = asyncio.Event()  # a second signal: stop without waiting for generations in flight
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())
    socks = socks if socks is not None else listen(settings.host, settings.port)
    state = state or progress.terminal()
    front: web.AppRunner | None = web.AppRunner(loading_app(state), shutdown_timeout=1.0)
    runner: web.AppRunner | None = None
    t0 = time.perf_counter()
    try:
        assert front is not None
        await front.setup()
        await _serve_on(front, socks)
        log.info("mgserve listening on http://%s:%d (loading the model)", settings.host,
                 settings.port)  # fmt: skip
        try:
            service = await _first(load_in_thread(load, state), stop)
        except ValueError:
            raise  # a user error (bad file, a plan that does not fit): the CLI prints it
        except Exception as e:
            log.error("loading the model failed: %s: %s", type(e).__name__, e, exc_info=e)
            return 1
        if service is None:
            log.info("stopped while loading the model")
            return 0
        from mgserve.api.app import create_app  # imported already by the loading thread

        # handler_cancellation: a client that disconnects cancels its handler, whose `finally`
        # aborts the request, so the slot frees even while the handler waits for a token
        runner = web.AppRunner(
            create_app(service), handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await runner.setup()
        await _serve_on(runner, socks)
        await front.cleanup()  # from here on the app answers every connection
        front = None
        log.info("model ready after %.1f s; serving", time.perf_counter() - t0)
        await stop.wait()
        await drain(runner, service.drain, force, socks)
        return 0
    finally:
        # aiohttp's order: stop listening, close idle connections, wait for handlers, then run
        # the cleanup contexts (the engine stops last)
        if runner is not None:
            await runner.cleanup()
        if front is not None:
            await front.cleanup()
        for s in socks:
            s.close()


def _build(settings: Settings) -> Service:
    from mgserve.api.app import create_app  # noqa: F401  (its import, off the event loop)
    from mgserve.api.service import build_service

    return build_service(settings)


async def drain(
    runner: web.AppRunner, gens: Drain, force: asyncio.Event, socks: Sequence[socket.socket] = ()
) -> None:
    """Stop listening (a new connection is refused), refuse new generations on open connections
    (503), give those in flight SHUTDOWN_TIMEOUT_S to finish, then end the rest with an error."""
    for site in list(runner.sites):
        await site.stop()
    for s in socks:  # the sites listened on duplicates: close the port itself too
        s.close()
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
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build
        return asyncio.run(serve_async(settings))
    return uvloop.run(serve_async(settings))
