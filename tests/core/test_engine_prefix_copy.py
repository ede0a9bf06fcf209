"""Prefix copy on the reference engine, tiny qwen3next and qwen4exp (a checkpoint or the live
recurrent state copied) and qwen3 (K/V rows): the scenarios of tests/core/copy_turns.py. A
second session sharing a running one's system prompt computes only past the copied prefix and
answers as a fresh engine does; the threshold holds; aborting the source while the copy's step
runs harms nobody; a live copy answers as the source slot itself would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request
from tests.core import test_engine_checkpoints
from tests.core.checkpoint_turns import PARAMS
from tests.core.conftest import require_chunk_invariance
from tests.core.copy_turns import COPIED, COPY_SETTINGS, N_A, N_B, A, B, alone, beside, pinned
from tests.prom import metric

OTHER = [3 + (i * 11) % 140 for i in range(40)]  # a prompt sharing nothing with A or B


model = test_engine_checkpoints.model  # the tiny qwen3next, qwen4exp and qwen3, by module


async def test_a_second_session_copies_a_running_ones_system_prompt(model: Any) -> None:
    require_chunk_invariance(model)
    engine = Engine(model, COPY_SETTINGS)
    await engine.start()
    try:
        a, b = await beside(engine)
        reg = engine.metrics.registry
    finally:
        await engine.stop()
    copied = COPIED[model.rewindable]
    assert b.n_cached == copied and a.n_cached == 0
    assert metric(reg, "mgserve_prefix_copies_total") == 1
    assert metric(reg, "mgserve_prompt_tokens_reused_total") == copied
    assert metric(reg, "mgserve_prompt_cache_hits_total") == 1
    assert metric(reg, "llamacpp:prompt_tokens_total") == len(A) + len(B) - copied

    def fresh() -> Engine:
        return Engine(model, COPY_SETTINGS)

    assert await alone(fresh, B, N_B) == b._replace(n_cached=0)  # tokens, logprobs, top
    assert await alone(fresh, A, N_A) == a


async def test_a_copy_must_reuse_the_threshold_more(model: Any) -> None:
    engine = Engine(model, dataclasses.replace(COPY_SETTINGS, prefix_copy_min=151))
    await engine.start()
    try:
        _, b = await beside(engine)
        assert metric(engine.metrics.registry, "mgserve_prefix_copies_total") == 0
    finally:
        await engine.stop()
    assert b.n_cached == 0


async def test_aborting_the_source_while_the_copy_runs_is_harmless(model: Any) -> None:
    require_chunk_invariance(model)
    engine = Engine(model, COPY_SETTINGS)
    await engine.start()
    try:  # the source's slot goes to OTHER the step after the copy
        a, b = await beside(engine, abort_source=Request("c", OTHER, PARAMS, max_tokens=N_B))
        assert engine.slots()[0]["id_task"] == "c"
    finally:
        await engine.stop()
    assert len(a.tokens) < N_A and b.n_cached == COPIED[model.rewindable]
    assert await alone(lambda: Engine(model, COPY_SETTINGS), B, N_B) == b._replace(n_cached=0)


async def test_a_live_copy_answers_as_the_source_slot_does(model: Any) -> None:
    answers = []
    for slot in (1, 0):  # the second turn in another slot (a copy), then in its own
        engine = Engine(model, COPY_SETTINGS)
        await engine.start()
        try:
            answers.append(await pinned(engine, slot))
            copies = metric(engine.metrics.registry, "mgserve_prefix_copies_total")
        finally:
            await engine.stop()
        assert copies == (slot == 1)
    assert answers[0].n_cached == len(A) + N_B - 1  # the whole history (its last token unfed)
    assert answers[0] == answers[1]
