"""bench spec-sim's replay: the cost curve, and policies on continuations whose drafts hold or
do not (no model needed)."""

from __future__ import annotations

import random

import pytest

from mgserve.bench.spec_sim import DEFAULT, Policy, parse_costs, simulate, step_cost


def test_step_cost_is_linear_between_the_measured_points_and_beyond() -> None:
    costs = parse_costs("4:1.5,8:2.0")
    assert step_cost(costs, 0) == 1.0
    assert step_cost(costs, 2) == pytest.approx(1.25)
    assert step_cost(costs, 6) == pytest.approx(1.75)
    assert step_cost(costs, 12) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="k:ratio"):
        parse_costs("0:1.0")


def test_a_copy_is_predicted_fast_and_noise_not_at_all() -> None:
    rng = random.Random(3)
    text = [rng.randrange(1000) for _ in range(300)]
    cheap = parse_costs("4:1.1,8:1.2,16:1.4")
    copied = simulate(text, text[:200], Policy(*DEFAULT), cheap)  # the answer repeats the prompt
    assert copied.speedup > 3 and copied.accepted / copied.proposed > 0.9
    noise = [rng.randrange(1000, 2000) for _ in range(200)]  # nothing to look up
    assert simulate(text, noise, Policy(*DEFAULT), cheap) == (1.0, 0, 0, 0)
    dear = parse_costs("4:5.0,8:9.0,16:17.0")  # a verify costs a token per draft: no gain
    assert simulate(text, text[:200], Policy(*DEFAULT), dear).speedup <= 1.0
