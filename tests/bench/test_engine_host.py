"""``mgserve bench engine-host``: the engine's own time per decode step, with a runner that returns
at once, on the built-in model's vocabulary; every token asked for is streamed back."""

from __future__ import annotations

import argparse

import pytest

from mgserve.bench import engine_host
from tests.bench.cli_args import bench_args


def _args(**kw: object) -> argparse.Namespace:
    return bench_args(engine_host, **{**kw})


def test_times_a_step_for_each_session_count(capsys) -> None:
    assert engine_host.run(_args(sessions="1,3", tokens=25)) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 4  # each printed as measured, then the table
    for line in rows:
        steps, us, handoff = (float(c) for c in line.strip("| ").split(" | ")[1:])
        assert steps == 25 and us > 0 and handoff > 0  # one step a token, every session each


def test_the_instant_runner_answers_only_sampling_work() -> None:
    from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork

    greedy = SamplingParams(temperature=0.0)
    batch = ScheduledBatch(7, (SeqWork(0, "a", (1, 2, 3), 0, False, greedy),
                               SeqWork(1, "b", (4,), 9, True, greedy)))  # fmt: skip
    result = engine_host.InstantRunner().run(batch)
    assert result.step == 7 and result.n_tokens == 4
    assert [(r.slot, r.request_id, r.token) for r in result.results] == [(1, "b", 42)]


def test_refuses_what_it_cannot_time() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        engine_host.run(_args(sessions="0"))
