"""``n`` choices of one OpenAI request: n engine requests on one prompt, decoded side by side.

Each choice is a ``Request`` of its own in a slot of its own. They are submitted together (the
engine drains its inbox before it plans a step), so they are admitted and decode in the same steps
when slots are free. Choice 0 keeps the request's seed, so it is the answer the same request with
n=1 gives; choice i > 0 takes a seed derived from it, so a seeded request gives the same n choices
every time. Without a seed every choice draws its own; greedy choices are identical.

What it costs: the scheduler reuses a slot's own earlier cache, never another running slot's, so
each choice computes the prompt in its own slot: n prefills (in the same steps as far as
--batch-size allows) and n slots of KV. Usage counts the prompt once and sums the choices' tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from mgserve.api.generate import Chunk, Generation, TokenOut, timings
from mgserve.api.protocol import GenParams
from mgserve.api.service import Service
from mgserve.core.engine.contract import Request


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's for choice 0, else 63 bits hashed from both."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def choice_requests(req: Request, n: int) -> list[Request]:
    """The n engine requests of ``req`` (itself for n=1)."""
    if n == 1:
        return [req]
    seed = req.sampling.seed
    return [
        dataclasses.replace(
            req,
            id=f"{req.id}-{i}",
            sampling=dataclasses.replace(
                req.sampling, seed=None if seed is None else choice_seed(seed, i)
            ),
        )
        for i in range(n)
    ]


class Choices:
    """The ``params.n`` generations of one request, as one ``Generation`` is used: in a ``with``
    block (leaving it aborts every choice still running), then ``collect()`` or ``chunks()``."""

    def __init__(
        self,
        service: Service,
        request: Request,
        params: GenParams,
        http_request: web.Request | None = None,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self._waiting: dict[asyncio.Future[Chunk], int] = {}  # chunks() in flight: choice
        self.gens: list[Generation] = []
        try:
            for i, r in enumerate(choice_requests(request, params.n)):
                self.gens.append(Generation(service, r, params, http_request, keep, index=i))
        except Exception:  # the queue had no room for them all (a 503): none of them runs
            self.close()
            raise

    def __enter__(self) -> Choices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fut in self._waiting:
            fut.cancel()
        for g in self.gens:
            g.close()

    async def collect(self) -> list[tuple[str, list[TokenOut]]]:
        """Every choice run to its end (``Generation.collect`` each, concurrently)."""
        return list(await asyncio.gather(*(g.collect() for g in self.gens)))

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Every choice's chunks, interleaved as they come (``Chunk.index`` says whose)."""
        if len(self.gens) == 1:
            async for c in self.gens[0].chunks():
                yield c
            return
        iters = [g.chunks() for g in self.gens]
        for i, it in enumerate(iters):
            self._waiting[asyncio.ensure_future(anext(it))] = i
        try:
            while self._waiting:
                done, _ = await asyncio.wait(self._waiting, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=self._waiting.__getitem__):
                    i = self._waiting.pop(fut)
                    try:
                        c = fut.result()
                    except StopAsyncIteration:
                        continue
                    self._waiting[asyncio.ensure_future(anext(iters[i]))] = i
                    yield c
        finally:
            self.close()

    @property
    def failure(self) -> str:
        """What a client is told when a choice failed (finish_reason "error")."""
        return next(g.failure for g in self.gens if g.finish_reason == "error")

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the prompt once, every choice's tokens."""
        n_prompt = self.gens[0].n_prompt
        n_generated = sum(g.n_generated for g in self.gens)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_generated,
            "total_tokens": n_prompt + n_generated,
            "prompt_tokens_details": {"cached_tokens": min(g.n_cached for g in self.gens)},
        }

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings`` over all choices: the prompt work of every slot, all
        generated tokens, from the first submit to the last choice's end."""
        if len(self.gens) == 1:
            return self.gens[0].timings()
        t0 = min(g.t_submit for g in self.gens)
        now = time.perf_counter()
        end = max(g.t_end or now for g in self.gens) - t0
        prompt = max(
            g.t_submit - t0 + (end if g.t_prompt_done is None else g.t_prompt_done)
            for g in self.gens
        )
        return timings(
            sum(g.n_prompt for g in self.gens),
            sum(g.n_cached for g in self.gens),
            sum(g.n_generated for g in self.gens),
            prompt,
            end,
        )
