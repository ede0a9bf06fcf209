"""One request's side of the engine: what ``Engine.submit`` gives back (a ``RequestStream`` of its
events, or ``QueueFull``), its abort, and its prompt-progress events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mgserve.core.engine.contract import PromptProgress, Request, TokenEvent


class QueueFull(Exception):
    """``submit`` found --max-queue requests already waiting for a slot."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(
            f"the server is busy: {waiting} requests are already waiting for a slot "
            "(--max-queue); retry later"
        )
        self.retry_after = retry_after  # seconds, an estimate of when a place frees


class RequestStream:
    """Async iterator of one request's ``TokenEvent``s; ends after the one with a finish_reason."""

    def __init__(self, req: Request, abort: Callable[[str, str], None]) -> None:
        self.req = req
        self.request_id = req.id
        self._abort = abort  # the engine's: drops the request from its slot or the queue
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._finished = False  # the final event was handed to the reader
        self._aborted = False
        self.t_submit = time.monotonic()
        self.t_last = self.t_submit  # last token delivered, for the inter-token latency
        self.t_start: float | None = None  # its first work was planned: it holds a slot
        self.n_cache = 0  # prompt tokens its slot's cache held when it started

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._finished:
            raise StopAsyncIteration
        ev = await self._events.get()
        if ev.finish_reason is not None:
            self._finished = True
        return ev

    def abort(self, finish_reason: str = "abort") -> None:
        """Free the request's slot (or queue place) now; iteration ends with an event of
        ``finish_reason`` (if not finished first): "abort" for a client gone, "stop" where the
        caller matched a stop string (so metrics do not count it as a cancellation)."""
        if not self._aborted:
            self._aborted = True
            self._abort(self.request_id, finish_reason)

    def started(self, n_cache: int) -> None:
        """Its first work was planned, past ``n_cache`` prompt tokens its slot held."""
        self.t_start, self.n_cache = time.monotonic(), n_cache

    def progress(self, slot: int, processed: int) -> TokenEvent:
        """A progress event: ``processed`` prompt tokens are in ``slot``'s cache."""
        assert self.t_start is not None
        ms = int((time.monotonic() - self.t_start) * 1e3)
        total = len(self.req.prompt)
        return TokenEvent(
            self.request_id,
            None,
            slot,
            n_prompt=total,
            n_cached=self.n_cache,
            progress=PromptProgress(total, self.n_cache, processed, ms),
        )
