"""The speculation gate: users, the cost table (prior, measured, warm-up, interpolation), the
acceptance gate and its probe, and the bounds (limit, draft_min)."""

from __future__ import annotations

import pytest

from mgserve.spec.gate import COST_SLOPE, SpecGate

PLAIN = 0.010  # seconds of a plain decode step
DEPTH = 1000


def measured(
    gate: SpecGate,
    n_draft: int,
    seconds: float,
    n_sessions: int = 1,
    times: int = 3,
    depth: int = DEPTH,
) -> None:
    for _ in range(times):  # the first of each kind is a warm-up, not kept
        gate.observe_step(n_draft, depth, n_sessions, seconds)


def ready(n_sessions: int = 1, **kw: float) -> SpecGate:
    gate = SpecGate(**kw)  # type: ignore[arg-type]
    gate.start("r")
    measured(gate, 0, PLAIN, n_sessions)
    return gate


def rate(a: float, k: int, cost: float) -> float:
    return sum(a**i for i in range(k + 1)) / cost


def test_nothing_before_a_plain_step_of_as_many_sessions_is_measured() -> None:
    gate = SpecGate()
    gate.start("r")
    assert gate.draft_length("r", 1, DEPTH, 16) == 0
    gate.observe_step(0, DEPTH, 1, PLAIN)  # a warm-up: not kept
    assert gate.draft_length("r", 1, DEPTH, 16) == 0
    gate.observe_step(0, DEPTH, 1, PLAIN)
    assert gate.draft_length("r", 1, DEPTH, 16) > 0
    assert gate.draft_length("r", 2, DEPTH, 16) == 0  # two sessions: not measured yet


def test_the_prior_cost_picks_the_best_expected_rate() -> None:
    gate = ready()
    # a = 0.8 at the start; cost(k) = PLAIN * (1 + COST_SLOPE * k) before any verify is measured
    rates = {k: rate(0.8, k, 1 + COST_SLOPE * k) for k in (1, 2, 4, 8, 16)}
    assert gate.draft_length("r", 1, DEPTH, 16) == max(rates, key=rates.__getitem__) == 8


def test_more_users_than_the_setting_never_draft() -> None:
    gate = SpecGate(max_users=2)
    gate.start("r")
    for n in (1, 2, 3, 4):
        measured(gate, 0, PLAIN, n_sessions=n)
    assert [gate.draft_length("r", n, DEPTH, 16) > 0 for n in (1, 2, 3, 4)] == [
        True, True, False, False,
    ]  # fmt: skip
    never = SpecGate(max_users=0)
    never.start("r")
    measured(never, 0, PLAIN)
    assert never.draft_length("r", 1, DEPTH, 16) == 0


def test_a_verify_measured_too_expensive_closes_the_gate_without_probes() -> None:
    gate = ready()
    measured(gate, 4, PLAIN * 5)  # a CPU step: each draft row costs a whole token
    assert all(gate.draft_length("r", 1, DEPTH, 16) == 0 for _ in range(100))


def test_measured_cheap_verifies_keep_long_drafts() -> None:
    gate = ready()
    measured(gate, 16, PLAIN * 1.05)
    gate.verified("r", 16, 16)
    gate.verified("r", 16, 16)
    assert gate.draft_length("r", 1, DEPTH, 16) == 16
    # interpolated from the k = 16 cell: cost(k) = PLAIN + k * (0.05 * PLAIN / 16)
    assert gate.cost(4, DEPTH.bit_length(), 1, PLAIN) == pytest.approx(PLAIN * (1 + 0.05 / 4))


def test_a_warm_up_step_and_a_lone_slow_step_do_not_close_the_gate() -> None:
    gate = ready()
    gate.observe_step(8, DEPTH, 1, 10.0)  # the first verify: a graph was captured
    assert gate.draft_length("r", 1, DEPTH, 16) > 0
    for s in (PLAIN * 1.1, PLAIN * 1.1, 5.0, PLAIN * 1.1):  # one collection pause among them
        gate.observe_step(8, DEPTH, 1, s)
    assert gate.cost(8, DEPTH.bit_length(), 1, PLAIN) == pytest.approx(PLAIN * 1.1)
    assert gate.draft_length("r", 1, DEPTH, 16) > 0


def test_the_nearest_depths_measurements_stand_in() -> None:
    gate = ready()
    deep = DEPTH * 1000  # no plain step measured at this depth: DEPTH's stands in
    assert gate.draft_length("r", 1, deep, 16) > 0
    measured(gate, 2, PLAIN * 3, depth=deep)  # each draft costs a plain step (DEPTH's)
    assert gate.draft_length("r", 1, deep, 16) == 0
    # no draft measured at DEPTH: the deep bucket's cost per draft holds there too
    assert gate.draft_length("r", 1, DEPTH, 16) == 0
    measured(gate, 8, PLAIN * 1.1)  # measured cheap at DEPTH: open there, not deep
    assert gate.draft_length("r", 1, DEPTH, 16) > 0
    assert gate.draft_length("r", 1, deep, 16) == 0


def test_low_acceptance_stops_drafts_and_a_probe_brings_them_back() -> None:
    gate = ready(probe_every=5, probe_k=3)
    while gate.acceptance("r") >= gate.min_acceptance:
        assert gate.draft_length("r", 1, DEPTH, 16) > 0
        gate.verified("r", 8, 0)
    ks = [gate.draft_length("r", 1, DEPTH, 16) for _ in range(5)]
    assert ks == [0, 0, 0, 0, 3]  # held back, then one short probe
    assert gate.draft_length("r", 1, DEPTH, 16) == 3  # the probe found no drafts: again
    gate.verified("r", 3, 0)  # a failed probe: wait twice as long
    assert [gate.draft_length("r", 1, DEPTH, 16) for _ in range(10)] == [0] * 9 + [3]
    gate.verified("r", 3, 0)  # and again: four times
    assert [gate.draft_length("r", 1, DEPTH, 16) for _ in range(20)] == [0] * 19 + [3]
    gate.verified("r", 3, 3)  # the text turned repetitive: the probe held
    assert gate.acceptance("r") >= gate.min_acceptance
    assert gate.draft_length("r", 1, DEPTH, 16) > 0


def test_acceptance_is_per_session_and_forgotten_at_finish() -> None:
    gate = ready()
    gate.start("s")
    for _ in range(20):
        gate.verified("r", 8, 0)
        gate.verified("s", 8, 8)
    assert gate.acceptance("r") < 0.1 < 0.9 < gate.acceptance("s")
    gate.finish("r")
    assert gate.draft_length("r", 1, DEPTH, 16) == 0  # unknown: never drafts
    gate.start("r")  # a new request under the same id starts from the prior
    assert gate.acceptance("r") == pytest.approx(gate.prior_acceptance)


@pytest.mark.parametrize(
    ("limit", "draft_min", "expected"),
    [
        (16, 0, 8),  # the cost table's choice
        (3, 0, 3),  # bounded by the limit
        (1, 0, 1),
        (0, 0, 0),
        (16, 12, 12),  # raised to the request's minimum
        (16, 4, 8),
        (16, 16, 16),
        (5, 6, 0),  # the minimum does not fit the limit: nothing
    ],
)
def test_bounds(limit: int, draft_min: int, expected: int) -> None:
    assert ready().draft_length("r", 1, DEPTH, limit, draft_min) == expected


# verify step / plain step for k = 4, 8, 16, 48, as measured on an H100 (BENCHMARKS.md,
# 2026-12-05): full-width qwen4exp at 4k (whole runner steps, rollback included), Gemma 3 270M
MEASURED = {
    "qwen4exp": {4: 4.41, 8: 5.66, 16: 8.26, 48: 17.88},
    "gemma3-270m": {4: 1.51, 8: 2.14, 16: 3.46, 48: 8.0},
}


def gate_with(model: str) -> SpecGate:
    gate = ready()
    for k, ratio in MEASURED[model].items():
        measured(gate, k, PLAIN * ratio)
    return gate


def settle(gate: SpecGate, n_draft: int, n_accepted: int) -> None:
    """Verify steps until the session's acceptance is that pattern's (n_accepted / (n + 1))."""
    for _ in range(60):
        gate.verified("r", n_draft, n_accepted)


@pytest.mark.parametrize(
    ("model", "accepted_of_4", "limit", "expected"),
    [
        ("qwen4exp", 2, 16, 0),  # acceptance 2/3, the Gemma rewrite's (0.63): a verify costs more
        ("qwen4exp", 4, 16, 16),  # everything holds: 17 tokens for 8.26 plain steps
        ("qwen4exp", 4, 48, 48),  # and 49 for 17.88 where 48 drafts are allowed
        ("qwen4exp", 2, 48, 0),
        ("gemma3-270m", 2, 16, 4),  # at 2/3 a short draft pays on the small dense model
        ("gemma3-270m", 4, 16, 16),
    ],
)
def test_the_measured_verify_costs_decide(
    model: str, accepted_of_4: int, limit: int, expected: int
) -> None:
    """The gate's choices from the H100 figures: what drafting is worth on each model."""
    gate = gate_with(model)
    settle(gate, 4, accepted_of_4)
    picks = []
    for _ in range(64):
        picks.append(gate.draft_length("r", 1, DEPTH, limit))
        if picks[-1]:  # the step verifies them, holding as before
            gate.verified("r", picks[-1], min(picks[-1], picks[-1] * accepted_of_4 // 4))
    if expected:
        assert picks == [expected] * 64
    else:  # only the acceptance probes, every 16 steps at most
        assert sum(p > 0 for p in picks) <= 64 // 16 and set(picks) <= {0, gate.probe_k}
