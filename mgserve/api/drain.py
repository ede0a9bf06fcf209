"""Graceful shutdown's bookkeeping: the generations in flight, and the refusal of new ones.

On SIGTERM (server.py) the listening socket closes first (a new connection is refused), then
``Drain.close`` makes every new generation a 503 ``shutting down`` (a request on a connection kept
alive), and ``Drain.wait`` gives those in flight up to the shutdown timeout to finish. Any still
running then ends with a clean error, an error event closing its stream or a 503, never a cut
connection; the engine stops after that.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Protocol

from mgserve.api.errors import ApiError

SHUTTING_DOWN = "the server is shutting down"


class Live(Protocol):
    """What Drain needs of a generation (generate.Generation)."""

    finish_reason: str | None

    def shut_down(self) -> None: ...


class Drain:
    def __init__(self) -> None:
        self.closed = False
        self._live: weakref.WeakSet[Live] = weakref.WeakSet()
        self._changed = asyncio.Event()

    def admit(self, gen: Live) -> None:
        """Count ``gen`` in flight; a 503 once shutdown began."""
        if self.closed:
            raise ApiError(SHUTTING_DOWN, 503, retry_after=5)
        self._live.add(gen)

    def ended(self) -> None:
        """A generation finished (whatever its reason): ``wait`` looks again."""
        self._changed.set()

    def running(self) -> list[Live]:
        return [g for g in self._live if g.finish_reason is None]

    def close(self) -> None:
        self.closed = True

    async def wait(self, timeout: float, force: asyncio.Event | None = None) -> int:
        """Until nothing is in flight, ``timeout`` passes or ``force`` is set; then ends what is
        left with a clean error. Returns how many were ended so."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.running() and loop.time() < end and not (force and force.is_set()):
            self._changed.clear()
            try:  # a generation that ends sets _changed; the poll covers a forced stop
                await asyncio.wait_for(self._changed.wait(), min(0.1, end - loop.time()))
            except TimeoutError:
                pass
        left = self.running()
        for gen in left:
            gen.shut_down()
        return len(left)
