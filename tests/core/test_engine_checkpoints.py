"""Prefix reuse through recurrent-state checkpoints, on the reference engine: tiny qwen3next and
qwen4exp (checkpoints) and qwen3 (a KV cache, which needs none). A second turn, an edited turn and
a shared system prompt each compute only the tokens after the nearest checkpoint (or the common
prefix), and answer exactly as a fresh engine does (tokens, logprobs, top candidates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.engine.actor import Engine
from mgserve.core.models import load_model
from mgserve.core.models.base import SeqInput
from tests.core import hybrid_export, qwen4exp_export, tiny
from tests.core.checkpoint_turns import (
    KV_CACHED,
    LIVE_TURN,
    RECURRENT_CACHED,
    SETTINGS,
    cold,
    conversation,
)
from tests.core.conftest import require_chunk_invariance
from tests.prom import metric

MAKERS: dict[str, Callable[[Path], Path]] = {
    "qwen3next": lambda p: hybrid_export.export(
        hybrid_export.hf_model("qwen3next"), "qwen3next", p
    ),
    "qwen4exp": lambda p: qwen4exp_export.export(qwen4exp_export.hf_model(), p),
    "qwen3": lambda p: tiny.export(tiny.hf_model("qwen3"), "qwen3", p),
}


class Recording:
    """The model, recording every forward as (start, tokens) per session."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.spec, self.rewindable = model.spec, model.rewindable
        self.calls: list[tuple[int, int]] = []

    def new_cache(self, *args: Any) -> Any:
        return self.model.new_cache(*args)

    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        self.calls.extend((s.start, s.tokens.numel()) for s in seqs)
        return self.model.forward(seqs)


@pytest.fixture(scope="module", params=list(MAKERS))
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, one_thread: None
) -> Any:
    path = MAKERS[request.param](tmp_path_factory.mktemp("m") / "model.gguf")
    return load_model(path, threads=1)


async def test_turns_compute_only_past_the_nearest_checkpoint(model: Any) -> None:
    require_chunk_invariance(model)
    rec = Recording(model)
    engine = Engine(rec, SETTINGS)
    await engine.start()
    try:
        prompts, answers = await conversation(engine)
        metrics = engine.metrics.registry
    finally:
        await engine.stop()
    want = KV_CACHED if model.rewindable else RECURRENT_CACHED
    assert [a.n_cached for a in answers] == want
    # each prompt's tokens went through the model once, from where its reuse ended
    computed = sum(n for _, n in rec.calls)
    n_decode = len(prompts) * (len(answers[0].tokens) - 1)
    assert computed == sum(len(p) - c for p, c in zip(prompts, want, strict=True)) + n_decode
    restores = 0 if model.rewindable else 2
    assert metric(metrics, "mgserve_checkpoint_restores_total") == restores
    assert metric(metrics, "mgserve_prompt_tokens_reused_total") == sum(want)
    assert metric(metrics, "mgserve_prompt_cache_hits_total") == sum(c > 0 for c in want)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        want_a = await cold(lambda: Engine(model, SETTINGS), p)
        if i == LIVE_TURN and not model.rewindable:
            assert want_a.tokens == a.tokens
            assert want_a.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        else:
            assert want_a == a._replace(n_cached=0)


async def test_checkpoints_moved_to_host_and_a_cap_of_one_still_restore(model: Any) -> None:
    if model.rewindable:
        pytest.skip("a KV cache takes no checkpoints")
    settings = dataclasses.replace(SETTINGS, ctx_checkpoints=1, cache_ram=1)
    engine = Engine(model, settings)
    await engine.start()
    try:
        prompts, answers = await conversation(engine)
        assert metric(engine.metrics.registry, "mgserve_checkpoint_host_bytes")
    finally:
        await engine.stop()
    assert [a.n_cached for a in answers] == RECURRENT_CACHED
    for p, a in zip(prompts[2:], answers[2:], strict=True):
        assert await cold(lambda: Engine(model, SETTINGS), p) == a._replace(n_cached=0)


async def test_without_checkpoints_only_the_whole_history_is_reused(model: Any) -> None:
    if model.rewindable:
        pytest.skip("a KV cache takes no checkpoints")
    engine = Engine(model, dataclasses.replace(SETTINGS, ctx_checkpoints=0))
    await engine.start()
    try:
        _, answers = await conversation(engine)
    finally:
        await engine.stop()
    assert [a.n_cached for a in answers] == [0, 183, 0, 0]
