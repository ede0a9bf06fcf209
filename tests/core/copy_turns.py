"""Two sessions sharing a long system prompt on different slots, for the prefix copy tests of
every runner (the prompts of tests/core/checkpoint_turns.py; greedy with logprobs).

``beside``: session A (``SYSTEM + USER1``) decodes in slot 0 when B (``SYSTEM + USER4``) arrives;
B takes slot 1 and A's prefix is copied in: the common 150 tokens on a KV cache, A's checkpoint
at 128 on a recurrent model (its chunks of 32 cut at multiples of 64 and at 160). B must answer
as a fresh engine does, bit for bit, and A as if alone. ``pinned``: A's whole history (its
prompt and the tokens fed back) copied, live, into the slot a second turn is pinned to; it must
answer as the turn in A's own slot does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, ScheduledBatch, StepResult, TokenEvent
from mgserve.core.engine.stream import RequestStream
from tests.core.checkpoint_turns import (
    PARAMS,
    SETTINGS,
    SYSTEM,
    USER1,
    USER2,
    USER4,
    Answer,
    answer_of,
)

COPY_SETTINGS = dataclasses.replace(SETTINGS, parallel=2, prefix_copy_min=64)
A = SYSTEM + USER1
B = SYSTEM + USER4
N_A = 10  # A's tokens: it is still decoding while B's prompt runs
N_B = 4
COPIED = {True: 150, False: 128}  # by rewindable: the common prefix, A's checkpoint in it


async def answer(stream: RequestStream, *before: TokenEvent) -> Answer:
    """The answer of a request's events: ``before`` (read already), then the rest."""
    return answer_of([*before, *[ev async for ev in stream]])


def submit(
    engine: Engine, rid: str, prompt: list[int], n: int, slot: int | None = None
) -> RequestStream:
    return engine.submit(Request(rid, prompt, PARAMS, max_tokens=n, slot=slot))


async def alone(make_engine: Callable[[], Engine], prompt: list[int], n: int) -> Answer:
    engine = make_engine()
    await engine.start()
    try:
        return await answer(submit(engine, "cold", prompt, n))
    finally:
        await engine.stop()


def abort_during_copy(engine: Engine, source: RequestStream, then: Request) -> None:
    """When the runner gets a step with a prefix copy, abort ``source`` on the event loop and
    submit ``then`` (which takes the freed slot in the next step) before the step runs."""
    run, loop = engine._runner.run, asyncio.get_running_loop()

    def step(batch: ScheduledBatch) -> StepResult:
        if batch.prefix_copies:
            done = threading.Event()

            def act() -> None:
                source.abort()
                engine.submit(then)
                done.set()

            loop.call_soon_threadsafe(act)
            done.wait()
        return run(batch)

    engine._runner.run = step  # type: ignore[method-assign]


async def beside(engine: Engine, abort_source: Request | None = None) -> tuple[Answer, Answer]:
    """A, then B once A decodes; with ``abort_source``, A is aborted while the copy's step runs
    and that request submitted. A's answer and B's, on a started engine."""
    a = submit(engine, "a", A, N_A)
    first = await anext(a)
    assert first.token is not None and first.slot == 0
    if abort_source is not None:
        abort_during_copy(engine, a, abort_source)
    b = submit(engine, "b", B, N_B)
    got_b = await answer(b)
    return await answer(a, first), got_b


async def pinned(engine: Engine, slot: int) -> Answer:
    """A's first turn, then its second turn pinned to ``slot``, on a started engine."""
    a1 = await answer(submit(engine, "t1", A, N_B))
    return await answer(submit(engine, "t2", A + a1.tokens + USER2, N_B, slot))
