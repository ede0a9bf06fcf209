"""Text work (template rendering, tokenization) on a small thread pool of its own.

Tokenizing a long prompt takes as long as the prompt is long; on the event loop it would hold up
every other request, ``/health`` included. Handlers hand such work to this pool and await it, so
the loop keeps answering meanwhile. The pool is bounded (a few threads: the work is CPU-bound
Python, so more threads would only contend), and what one job may cost is bounded before it starts,
by the body size limit and by prompts.check_text_size.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

TEXT_WORKERS = 2
# A request body this small is rendered and tokenized on the loop: a few milliseconds at most,
# less than the hand-off, and it never waits behind a long job in the pool.
INLINE_BYTES = 4096


class TextPool:
    def __init__(self, workers: int = TEXT_WORKERS) -> None:
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the pool, or here when ``size`` (the bytes of text it works
        on) is at most INLINE_BYTES; its exceptions are raised here."""
        if size <= INLINE_BYTES:
            return fn(*args, **kwargs)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="mgserve-text")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Drop queued jobs and let the threads end (a running job finishes in its thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
