"""Speculation's counters on /metrics: EngineMetrics handed a SpecStats renders them (and without
one, none)."""

from __future__ import annotations

from prometheus_client import generate_latest

from mgserve.core.engine.metrics import EngineMetrics
from mgserve.core.engine.scheduler import Scheduler
from mgserve.spec.stats import SpecStats
from tests.prom import metric


def rendered(spec: SpecStats | None) -> str:
    m = EngineMetrics(Scheduler(n_slots=2, n_ctx=64, batch_size=8), lambda: 0, spec)
    return generate_latest(m.registry).decode()


def test_the_counters_as_prometheus_text() -> None:
    stats = SpecStats()
    stats.on_verified("a", 4, 2)  # drafts 0 and 1 held, 2 did not
    stats.on_verified("b", 3, 3)
    stats.on_verified("a", 2, 0)
    stats.on_verified("a", 0, 0)  # no drafts: not a verify
    for n in (4, 2, 0):
        stats.on_step(n)
    text = rendered(stats)
    assert "# TYPE mgserve_spec_draft_accepted_total counter\n" in text
    assert metric(text, "mgserve_spec_draft_proposed_total") == 9
    assert metric(text, "mgserve_spec_draft_accepted_total") == 5
    assert metric(text, "mgserve_spec_steps_total") == 2
    assert metric(text, "mgserve_spec_verifies_total") == 3
    assert metric(text, "mgserve_spec_tokens_emitted_total") == 3 + 5
    assert metric(text, "mgserve_spec_tokens_per_step") == 8 / 3
    accepted = [metric(text, "mgserve_spec_accepted_by_position_total", position=str(i))
                for i in range(5)]  # fmt: skip
    assert accepted == [2, 2, 1, None, None]
    proposed = [metric(text, "mgserve_spec_proposed_by_position_total", position=str(i))
                for i in range(5)]  # fmt: skip
    assert proposed == [3, 3, 2, 1, None]
    assert stats.by_request["a"].proposed == 6 and stats.by_request["a"].accepted == 2
    stats.on_finish("a")
    assert list(stats.by_request) == ["b"]


def test_a_fresh_speculator_exposes_zeros_and_no_speculator_nothing() -> None:
    text = rendered(SpecStats())
    assert metric(text, "mgserve_spec_draft_accepted_total") == 0
    assert metric(text, "mgserve_spec_tokens_per_step") == 0
    assert "mgserve_spec_" not in rendered(None)
