"""A conversation that exercises prefix reuse, for the engine tests of every runner: a first turn, a
second turn (the whole history and more), an edited turn (the last answer replaced) and a new
conversation on the same system prompt, one slot, greedy with logprobs.

With ``SETTINGS`` (chunks of 32, checkpoints every 64 tokens, a 150-token system prompt, a first
prompt of 180) a recurrent model reuses, per turn: nothing, the whole history (183), the first
turn's last checkpoint before its prompt's end (160) and the checkpoint at 128 inside the system
prompt; a KV cache reuses the common prefix (183, 180, 150). Every answer must be the one a fresh
engine gives the same prompt: bit for bit from a checkpoint, up to rounding from a recurrent
state continued past decoded tokens (the second turn; checkpoints.py says why).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams, TokenEvent

SETTINGS = Settings(parallel=1, ctx_size=256, batch_size=32, checkpoint_every=64)
PARAMS = SamplingParams(temperature=0.0, n_probs=3, want_logprob=True)
N_GEN = 4
SYSTEM = [3 + (i * 37) % 140 for i in range(150)]
USER1 = [5 + 4 * i for i in range(30)]
USER2 = [40, 30, 20, 10, 44, 33, 22, 11]
USER4 = [6, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48]
EDITED = [140, 141, 142]  # the edited answer: differs from anything the model says first

RECURRENT_CACHED = [0, 183, 160, 128]
KV_CACHED = [0, 183, 180, 150]
LIVE_TURN = 1  # the turn that continues a recurrent state past decoded tokens


class Answer(NamedTuple):
    tokens: list[int]
    logprobs: list[float | None]
    top: list[Any]
    n_cached: int


async def ask(engine: Engine, rid: str, prompt: list[int]) -> Answer:
    events = [ev async for ev in engine.submit(Request(rid, prompt, PARAMS, max_tokens=N_GEN))]
    assert events[-1].finish_reason == "length", events[-1]
    return answer_of(events)


def answer_of(events: list[TokenEvent]) -> Answer:
    """A request's answer from its events, the last one included."""
    got = [ev for ev in events if ev.token is not None]
    return Answer(
        [ev.token for ev in got],  # type: ignore[misc]
        [ev.logprob for ev in got],
        [ev.top for ev in got],
        events[-1].n_cached,
    )


async def conversation(engine: Engine) -> tuple[list[list[int]], list[Answer]]:
    """The four turns on a started engine: their prompts and answers."""
    p1 = SYSTEM + USER1
    a1 = await ask(engine, "t1", p1)
    assert a1.tokens[0] != EDITED[0]
    prompts = [p1, p1 + a1.tokens + USER2, p1 + EDITED + USER2, SYSTEM + USER4]
    answers = [a1]
    for i, p in enumerate(prompts[1:], 2):
        answers.append(await ask(engine, f"t{i}", p))
    return prompts, answers


async def cold(make_engine: Any, prompt: list[int]) -> Answer:
    engine: Engine = make_engine()
    await engine.start()
    try:
        return await ask(engine, "cold", prompt)
    finally:
        await engine.stop()
