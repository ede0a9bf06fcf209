"""Prefill paced beside decoders (pacing.py): the cost model, the budget, and the scheduler driven
by a fake runner whose step time is a function of what the step carries (simulated seconds, so
the numbers are exact): decoders' latency stays near the target, the prompt gets the rate left
over, prompts go in arrival order, and the cuts stay where they are without a target."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest

from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import ScheduledBatch
from mgserve.core.engine.pacing import MIN_STEPS, QUANTUM, PrefillPacer, StepCost
from mgserve.core.engine.scheduler import Scheduler
from tests.core.test_scheduler import answer, req

Cost = Callable[[int, int], float]  # (sessions decoding, prompt tokens) -> seconds


def linear(base: float, per_decoder: float, prompt_step: float, per_token: float) -> Cost:
    """A runner's step time: a fixed part, a part per decoder, a prompt step's own fixed part
    (a prefill forward reads the weights too) and a part per prompt token."""
    return lambda d, n: base + per_decoder * d + (prompt_step + per_token * n if n else 0.0)


def test_the_cost_model_fits_a_line_and_keeps_its_slope_in_the_steady_state() -> None:
    c = StepCost()
    assert c.fit(2) is None
    for n in (0, 64, 0, 128, 256, 0, 512):
        c.observe(2, n, 0.02 + 0.001 * n)
    base, per_token = c.fit(2)  # type: ignore[misc]
    assert base == pytest.approx(0.02) and per_token == pytest.approx(0.001)
    assert c.fit(3) is None and c.max_prompt(2) == 512
    for _ in range(40):  # the steady state, 10% dearer: the slope stays, the line moves up
        c.observe(2, 300, 1.1 * (0.02 + 0.001 * 300))
    base, per_token = c.fit(2)  # type: ignore[misc]
    assert per_token == pytest.approx(0.001, rel=0.05)
    assert base + 300 * per_token == pytest.approx(0.352)
    cold = StepCost()  # one prompt share only: the line through the steps without prompt tokens
    for n, t in ((0, 0.02), (200, 0.1), (200, 0.1)):
        cold.observe(1, n, t)
    assert cold.fit(1) == (pytest.approx(0.02), pytest.approx(0.0004))


def test_the_budget_is_a_whole_batch_without_target_or_decoders_and_grows_from_one_piece() -> None:
    assert PrefillPacer(0.0, 4096).budget(3) == 4096
    p = PrefillPacer(0.05, 4096)
    assert p.budget(0) == 4096
    assert p.budget(2) == QUANTUM  # nothing measured yet: one piece
    p.planned(1, 2, QUANTUM)
    p.observe(1, 0.001)  # very cheap: the budget may only double what was seen
    assert p.budget(2) == 2 * QUANTUM
    assert p.piece_end(0, 0, 4096, 200) == 192 and p.piece_end(100, 164, 300, 200) == 300
    assert p.piece_end(100, 100, 4196, 50) == 100  # no whole piece fits: wait
    assert PrefillPacer(0.0, 4096).piece_end(0, 0, 4096, 4000) == 0  # whole chunks only


def simulate(
    s: Scheduler, cost: Cost, steps: int, noise: float = 0.0
) -> tuple[list[float], list[ScheduledBatch], list[float]]:
    """Run ``steps`` steps with simulated times: (decode steps' seconds, batches, their times)."""
    rng = random.Random(0)
    itl, batches, times = [], [], []
    for _ in range(steps):
        b = s.schedule()
        if b is None:
            break
        n_dec = sum(w.request_id.startswith("d") for w in b.work)  # d0, d1 decode
        t = cost(n_dec, sum(len(w.tokens) for w in b.work) - n_dec)
        t *= 1 + noise * (2 * rng.random() - 1)
        s.apply(answer(b))
        s.observe(b.step, t)
        batches.append(b)
        times.append(t)
        if n_dec:
            itl.append(t)
    return itl, batches, times


def prompt_rate(batches: list[ScheduledBatch], times: list[float], rid: str = "p") -> float:
    """Prompt tokens of ``rid`` per second, over the steps from its first chunk to its last."""
    mine = [i for i, b in enumerate(batches) if any(w.request_id == rid for w in b.work)]
    return prompt_tokens(batches, rid) / sum(times[mine[0] : mine[-1] + 1])


def decoders_and_prompt(target: float, n_prompt: int, **kw: int) -> Scheduler:
    s = Scheduler(n_slots=4, n_ctx=1 << 16, batch_size=2048, itl_target=target, **kw)
    for rid in ("d0", "d1"):
        s.add(req(rid, list(range(1, 42)), max_tokens=10_000))
    b = s.schedule()
    assert b is not None
    s.apply(answer(b))  # both decode from now on
    s.add(req("p", [5] * n_prompt, max_tokens=1))
    return s


def prompt_tokens(batches: list[ScheduledBatch], rid: str = "p") -> int:
    return sum(len(w.tokens) for b in batches for w in b.work if w.request_id == rid)


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_decoders_stay_near_the_target_and_the_prompt_gets_the_rate_left_over(
    noise: float,
) -> None:
    cost = linear(0.010, 0.004, 0.005, 0.0002)
    target = 0.05
    s = decoders_and_prompt(target, 30_000)
    itl, batches, times = simulate(s, cost, 400, noise)
    assert statistics.median(itl) <= target * (1 + noise)
    piece = QUANTUM * 0.0002  # a step exceeds the target by less than a piece
    assert sorted(itl)[int(0.99 * len(itl))] <= (target + piece) * (1 + noise)
    # what the target leaves per step: (0.05 - 0.018 - 0.005) / 0.0002 = 135 tokens in 0.05 s
    left_over = (target - cost(2, 0) - 0.005) / 0.0002 / target
    assert prompt_tokens(batches) == 30_000
    assert prompt_rate(batches, times) >= 0.85 * left_over
    # untargeted, a whole 2048-token chunk goes beside the decoders: 0.43 s between their tokens
    untargeted, _, _ = simulate(decoders_and_prompt(0.0, 30_000), cost, 20)
    assert statistics.median(untargeted) > 8 * target


def test_a_target_tighter_than_one_piece_saves_up_and_never_stalls_the_prompt() -> None:
    cost = linear(0.020, 0.0, 0.0, 0.001)  # a piece (64 tokens) alone costs 64 ms
    s = decoders_and_prompt(0.030, 640)
    itl, batches, _ = simulate(s, cost, 200)
    # 10 ms left per step: 10 tokens of credit a step, a piece about every 7 steps
    with_prompt = [b for b in batches if any(w.request_id == "p" for w in b.work)]
    assert prompt_tokens(batches) == 640 and all(
        len(w.tokens) == QUANTUM for b in with_prompt for w in b.work if w.request_id == "p"
    )
    n_steps = batches.index(with_prompt[-1]) - batches.index(with_prompt[0])
    assert 6 * 9 <= n_steps <= 7 * 9 + 2
    assert statistics.median(itl) == pytest.approx(0.020)
    # a target decoding alone already misses: still a piece every MIN_STEPS steps
    s = decoders_and_prompt(0.010, 640)
    _, batches, _ = simulate(s, cost, 200)
    firsts = [i for i, b in enumerate(batches) if any(w.request_id == "p" for w in b.work)]
    gaps = [b - a for a, b in zip(firsts, firsts[1:], strict=False)]
    assert len(firsts) == 10 and max(gaps) <= MIN_STEPS + 1


def test_cuts_do_not_depend_on_the_target_and_checkpoints_stay_where_they_were() -> None:
    n = 5000

    def cuts(target: float) -> tuple[set[int], set[int]]:
        book = CheckpointBook(every=1024, per_slot=8, host_bytes=1 << 30, nbytes=1)
        s = Scheduler(n_slots=4, n_ctx=1 << 14, batch_size=512, itl_target=target,
                      rewindable=False, checkpoints=book)  # fmt: skip
        for rid in ("d0", "d1"):
            s.add(req(rid, [1, 2, 3], max_tokens=10_000))
        b = s.schedule()
        assert b is not None
        s.apply(answer(b))
        s.add(req("p", [9] * n, max_tokens=1))
        _, batches, _ = simulate(s, linear(0.01, 0.001, 0.0, 0.0001), 2000)
        ws = [w for b in batches for w in b.work if w.request_id == "p" and w.start < n]
        assert sum(len(w.tokens) for w in ws) == n
        return {w.start + len(w.tokens) for w in ws}, {
            w.start + len(w.tokens) for w in ws if w.checkpoint
        }

    whole, whole_ckpts = cuts(0.0)
    paced, paced_ckpts = cuts(0.02)
    assert whole == {*range(512, n, 512), n}
    assert paced > whole and all(c % QUANTUM == 0 for c in paced - {n})
    assert paced_ckpts == whole_ckpts == {1024, 2048, 3072, 4096, 4608}


def test_prompts_go_in_arrival_order() -> None:
    cost = linear(0.010, 0.004, 0.005, 0.0002)
    s = decoders_and_prompt(0.05, 3000, prefill_sessions=1)
    s.add(req("q", [6] * 3000, max_tokens=1))
    _, batches, _ = simulate(s, cost, 400)
    first_q = next(i for i, b in enumerate(batches) if any(w.request_id == "q" for w in b.work))
    last_p = max(i for i, b in enumerate(batches) if any(w.request_id == "p" for w in b.work))
    assert first_q > last_p  # q waited for p's whole prompt
    assert prompt_tokens(batches, "q") == 3000
