from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.engine.sampling import (
    PenaltyWindow,
    SeqSampler,
    apply_penalties,
    filter_candidates,
    logprobs_for,
)

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every filter off


def rand_logits(b: int = 4, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2  # [B, V]


def test_greedy_is_argmax() -> None:
    logits = rand_logits()
    for row in logits:
        s = SeqSampler(SamplingParams(temperature=0.0))
        assert s.sample(row) == int(torch.argmax(row))


def test_top_k_1_equals_greedy() -> None:
    logits = rand_logits(8)
    for i, row in enumerate(logits):
        s = SeqSampler(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=i))
        assert s.sample(row) == int(torch.argmax(row))


def test_same_seed_same_tokens_and_other_seeds_differ() -> None:
    row = torch.zeros(100)  # uniform: every draw is pure randomness
    params = SamplingParams(temperature=1.0, seed=1234, **OFF)  # type: ignore[arg-type]

    def draws(p: SamplingParams) -> list[int]:
        s = SeqSampler(p)
        return [s.sample(row) for _ in range(30)]

    assert draws(params) == draws(params)
    other = SamplingParams(temperature=1.0, seed=99, **OFF)  # type: ignore[arg-type]
    assert draws(params) != draws(other)
    assert len(set(draws(params))) > 10


def test_draws_follow_the_tempered_distribution() -> None:
    row = torch.tensor([0.0, math.log(2.0), math.log(4.0)])
    # temperature 2 flattens p ~ [1, 2, 4] to p ~ [1, sqrt 2, 2]
    s = SeqSampler(SamplingParams(temperature=2.0, seed=7, **OFF))  # type: ignore[arg-type]
    n = 6000
    freq = Counter(s.sample(row) for _ in range(n))
    want = torch.tensor([1.0, math.sqrt(2.0), 2.0])
    want = want / want.sum()
    for t in range(3):
        assert freq[t] / n == pytest.approx(float(want[t]), abs=0.02)


def test_penalties_change_the_right_logits_by_the_right_amounts() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, Counter({0: 2, 1: 1}), p)
    # token 0: 2 / 2 - 2 * 0.5 - 0.25; token 1: -1 * 2 - 1 * 0.5 - 0.25; 2 and 3 never seen
    assert logits.tolist() == pytest.approx([-0.25, -2.75, 0.5, 3.0])


def test_penalty_window_counts_only_the_last_n_tokens() -> None:
    assert PenaltyWindow(3, [1, 2, 1, 3, 4]).counts == Counter({1: 1, 3: 1, 4: 1})
    w = PenaltyWindow(-1, [1, 2, 1])
    w.extend([1])
    assert w.counts == Counter({1: 3, 2: 1})
    assert PenaltyWindow(0, [1, 2]).counts == Counter()


def test_repeat_penalty_uses_prompt_history() -> None:
    row = torch.tensor([1.0, 0.9, 0.0])
    p = SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=2)
    assert SeqSampler(p, history=[0]).sample(row) == 1  # 1.0 / 1.5 < 0.9
    assert SeqSampler(p, history=[0, 2, 2]).sample(row) == 0  # token 0 left the window


def test_logit_bias_minus_inf_bans_a_token() -> None:
    row = torch.tensor([5.0, 4.0, 0.0])
    ban = ((0, -math.inf),)
    assert SeqSampler(SamplingParams(temperature=0.0, logit_bias=ban)).sample(row) == 1
    s = SeqSampler(SamplingParams(temperature=1.0, logit_bias=ban, seed=3, **OFF))  # type: ignore[arg-type]
    assert 0 not in {s.sample(row) for _ in range(200)}
    assert row[0] == 5.0  # the caller's logits are not modified


def test_top_p_and_min_p_keep_the_right_sets() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()

    def kept(**kw: float) -> list[int]:
        p = SamplingParams(**{**OFF, **kw})  # type: ignore[arg-type]
        ids, _ = filter_candidates(logits, p)
        return ids.tolist()

    assert kept() == [1, 3, 2, 0]
    assert kept(top_p=0.75) == [1, 3]  # 0.5 < 0.75 <= 0.8
    assert kept(top_p=0.85) == [1, 3, 2]
    assert kept(top_p=0.1) == [1]  # at least one survives
    assert kept(min_p=0.25) == [1, 3, 2]  # p >= 0.125
    assert kept(min_p=0.5) == [1, 3]  # p >= 0.25
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=3, top_p=0.85, min_p=0.5) == [1, 3]


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ps = [SamplingParams(want_logprob=True, n_probs=2), SamplingParams()]
    (lp, top), (lp2, top2) = logprobs_for(logits, [0, 1], ps)
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3) + 1)
    assert lp == pytest.approx(1 - z)
    assert [t.token for t in top] == [2, 1]
    assert [t.logprob for t in top] == pytest.approx([3 - z, 2 - z])
    assert lp2 is None and top2 == ()
