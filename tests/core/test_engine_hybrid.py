"""The engine serving recurrent (Gated DeltaNet) models: prefix reuse must never rewind a state.

Tiny random qwen3next and qwen4exp models (tests/core/hybrid_export.py, qwen4exp_export.py). Each
request's greedy tokens must equal a fresh engine's, whether its slot's history is reused (the new
prompt extends it), goes back to a checkpoint (the prompts share only a part; more in
test_engine_checkpoints.py), or other sessions run beside.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams
from mgserve.core.models import load_model
from tests.core import hybrid_export, qwen4exp_export

GREEDY = SamplingParams(temperature=0.0)


def _qwen3next(path: Path) -> Path:
    return hybrid_export.export(hybrid_export.hf_model("qwen3next"), "qwen3next", path)


def _qwen4exp(path: Path) -> Path:
    return qwen4exp_export.export(qwen4exp_export.hf_model(), path)


@pytest.fixture(scope="module", params=[_qwen3next, _qwen4exp], ids=["qwen3next", "qwen4exp"])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, one_thread: None
) -> Any:
    make: Callable[[Path], Path] = request.param
    return load_model(make(tmp_path_factory.mktemp("m") / "model.gguf"), threads=1)


async def _generate(engine: Engine, rid: str, prompt: list[int]) -> list[int]:
    events = [ev async for ev in engine.submit(Request(rid, prompt, GREEDY, max_tokens=6))]
    assert events[-1].finish_reason == "length", events[-1]
    return [ev.token for ev in events if ev.token is not None]


async def _fresh(model: Any, prompt: list[int]) -> list[int]:
    engine = Engine(model, Settings(parallel=1, ctx_size=128, batch_size=16))
    await engine.start()
    try:
        return await _generate(engine, "fresh", prompt)
    finally:
        await engine.stop()


async def test_reused_and_dropped_histories_give_fresh_results(model: Any) -> None:
    assert not model.rewindable
    a = list(range(10, 40))
    engine = Engine(model, Settings(parallel=1, ctx_size=128, batch_size=16))
    await engine.start()
    try:
        out_a = await _generate(engine, "a", a)
        extends = a + out_a[:-1] + [7, 8, 9]  # the slot's whole history, then more
        shares = a[:20] + [5, 6]  # only part of it: back to the checkpoint at 16
        got = [await _generate(engine, rid, p) for rid, p in (("b", extends), ("c", shares))]
        assert engine.slots()[0]["n_past"] > 0
    finally:
        await engine.stop()
    assert got == [await _fresh(model, extends), await _fresh(model, shares)]


async def test_concurrent_sessions_match_alone(model: Any) -> None:
    prompts = [list(range(10, 40)), list(range(50, 57)), list(range(3, 24))]
    alone = [await _fresh(model, p) for p in prompts]
    engine = Engine(model, Settings(parallel=3, ctx_size=128, batch_size=16))
    await engine.start()
    try:
        together = await asyncio.gather(
            *(_generate(engine, f"r{i}", p) for i, p in enumerate(prompts))
        )
    finally:
        await engine.stop()
    assert list(together) == alone
