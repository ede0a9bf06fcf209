"""Sampling batches kept from step to step (cuda/sampling/kept.py), on the CPU: a row samples what
an exactly sized batch gives it whatever batch of its size class it lands in and whatever that
batch held before; a size class is found again as windows grow and batches change size; a lane
keeps at most MOST_KEPT of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.grammar.matcher import ForcedToken
from mgserve.cuda.sampling import DeviceSampler, SampleOutput, SamplingBatch, SamplingRow
from mgserve.cuda.sampling.kept import MOST_KEPT, kept_batch, size_class

CPU = torch.device("cpu")
SAMPLER = DeviceSampler()
V = 3000


class _Allow:
    """A grammar's mask: the tokens it allows."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens

    def fill(self, row: np.ndarray) -> None:
        row[:] = 0
        for t in self.tokens:
            row.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))

    def allowed(self) -> torch.Tensor:
        raise NotImplementedError


def _rows(step: int, n: int, grammar: bool = False) -> list[SamplingRow]:
    """n sessions at ``step``: greedy, plain, penalised with a growing window, biased, top-k with
    logprobs and the top 5; with ``grammar`` every other row under a mask (one a forced token)."""
    kinds = [
        SamplingParams(seed=2, temperature=0.0, want_logprob=True),
        SamplingParams(seed=3, temperature=0.9, top_p=0.9),
        SamplingParams(seed=4, repeat_penalty=1.3, presence_penalty=0.5, repeat_last_n=64),
        SamplingParams(seed=5, logit_bias=((7, 2.0), (9, -1.0), (7, 0.5))),
        SamplingParams(seed=6, top_k=20, min_p=0.05, want_logprob=True, n_probs=5),
    ]
    masks = [None, _Allow((7, 9, 64, 2999)), None, ForcedToken(11, V), None]
    return [
        SamplingRow(
            kinds[i % len(kinds)],
            [(11 * i + j) % V for j in range(step + i)],
            step,
            matcher=masks[i % len(masks)] if grammar else None,
        )
        for i in range(n)
    ]


def _same(got: SampleOutput, want: SampleOutput, what: object) -> None:
    for name, a, b in zip(got._fields, got, want, strict=True):
        assert (a is None) == (b is None), (what, name)
        assert a is None or torch.equal(a, b), (what, name, a, b)


@pytest.mark.parametrize("grammar", [False, True])
def test_a_kept_batch_samples_what_a_built_one_does(grammar: bool) -> None:
    """Steps of changing sizes through one lane's batches (a class refilled with fewer rows than
    it held, windows growing past 64): every output bitwise a built batch's."""
    kept: dict = {}
    for step, n in [(0, 3), (1, 5), (2, 1), (3, 4), (4, 2), (70, 5), (71, 2), (72, 5), (73, 3)]:
        rows = _rows(step, n, grammar)
        logits = torch.randn(n, V, generator=torch.Generator().manual_seed(step))
        want = SAMPLER.sample(logits, SamplingBatch.build(rows, V, CPU))
        batch = kept_batch(kept, rows, V, CPU)
        assert batch.size >= n and batch.n_rows == n
        _same(SAMPLER.sample(logits, batch), want, (step, n))
    assert 1 < len(kept) <= MOST_KEPT


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
    lru: dict = {}
    steady = kept_batch(lru, _rows(300, 1), V, CPU)
    for n in range(2, MOST_KEPT + 5):  # a class used every step stays; the others come and go
        other = _rows(300, 2 ** (n // 2), grammar=n % 2 == 1)
        kept_batch(lru, other, V, CPU)
        assert kept_batch(lru, _rows(301, 1), V, CPU) is steady, n
    with pytest.raises(ValueError, match="no rows"):
        kept_batch(kept, [], V, CPU)
