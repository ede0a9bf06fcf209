"""Sampling batches kept from step to step (cuda/sampling/kept.py), on the CPU: a row samples what
an exactly sized batch gives it whatever batch of its size class it lands in and whatever that
batch held before; a size class is found again as windows grow and batches change size; a lane
keeps at most MOST_KEPT of them."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.cuda.sampling import DeviceSampler, SamplingBatch, SamplingRow
from mgserve.cuda.sampling.kept import MOST_KEPT, kept_batch, size_class

CPU = torch.device("cpu")
SAMPLER = DeviceSampler()
V = 3000


def _rows(step: int, n: int) -> list[SamplingRow]:
    """n sessions at ``step``: greedy, plain, penalised with a growing window, biased, top-k."""
    kinds = [
        SamplingParams(seed=2, temperature=0.0),
        SamplingParams(seed=3, temperature=0.9, top_p=0.9),
        SamplingParams(seed=4, repeat_penalty=1.3, presence_penalty=0.5, repeat_last_n=64),
        SamplingParams(seed=5, logit_bias=((7, 2.0), (9, -1.0), (7, 0.5))),
        SamplingParams(seed=6, top_k=20, min_p=0.05),
    ]
    return [
        SamplingRow(kinds[i % len(kinds)], [(11 * i + j) % V for j in range(step + i)], step)
        for i in range(n)
    ]


def test_a_kept_batch_samples_what_a_built_one_does() -> None:
    kept: dict = {}
    for step, n in [(0, 3), (1, 5), (2, 1), (3, 4), (70, 5), (71, 2), (72, 5)]:
        rows = _rows(step, n)
        logits = torch.randn(n, V, generator=torch.Generator().manual_seed(step))
        want = SAMPLER.sample(logits, SamplingBatch.build(rows, V, CPU))
        batch = kept_batch(kept, rows, V, CPU)
        got = SAMPLER.sample(logits, batch)
        assert batch.size >= n and batch.n_rows == n
        assert torch.equal(got.tokens, want.tokens), (step, n, got.tokens, want.tokens)
        assert torch.equal(got.logprob, want.logprob) if want.logprob is not None else True


def test_size_classes_are_found_again() -> None:
    kept: dict = {}
    first = kept_batch(kept, _rows(9, 3), V, CPU)  # 3 rows, windows of 9..11, no bias
    assert kept_batch(kept, _rows(10, 3), V, CPU) is first  # windows of 10..12: the same class
    assert kept_batch(kept, _rows(10, 4), V, CPU) is not first  # a biased row: another
    assert size_class(_rows(6, 4), V) == (4, 16, 2, False)
    windows = {size_class(_rows(step, 1), V)[1] for step in range(0, 200)}
    assert windows == {0, 1, 2, 4, 8, 16, 32, 64}  # a growing window (repeat_last_n 64): few
    assert SamplingParams().repeat_last_n == 64
    for n in range(1, 2 * MOST_KEPT + 2):  # many row counts: the oldest classes go
        kept_batch(kept, _rows(300, n), V, CPU)
        assert len(kept) <= MOST_KEPT
    with pytest.raises(ValueError, match="no rows"):
        kept_batch(kept, [], V, CPU)
