"""Per-stage figures across processes (mgserve/pipeline/timing.py ``step_span``, stage_stats.py),
without a process group: what a rank records for an eager step and for a graph's replay (a
transport that stands in for ``DistTransport``'s replay hooks), how rank 0 combines the ranks'
figures, and the phase arithmetic the bench uses."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.core import Metric

from mgserve.core.gguf.reader import GGUFFile
from mgserve.pipeline.stage_stats import FIELDS, Peers, between, summary
from mgserve.pipeline.timing import Figures, StageTiming, families


def _samples(fams: Any) -> dict[tuple[str, tuple[str, ...]], float]:
    out = {}
    for f in fams:
        assert isinstance(f, Metric)
        for s in f.samples:
            out[s.name, tuple(s.labels.values())] = s.value
    return out


def test_a_rank_times_its_stage_its_wait_and_its_span() -> None:
    """Across processes a rank's span runs from the step's start to ``end`` (its own clock), the
    wait from asking for the hand-off to having it; nothing crosses a clock it does not own."""
    t = StageTiming(2, False, lambda: [0], step_span=True)
    t.begin()
    t.receiving(1)
    time.sleep(0.02)
    t.arrived(0)
    with t.stage(1):
        time.sleep(0.03)
    t.end()
    t.settle()
    f = t.figures()
    assert f.steps == 1 and f.link_seconds is None and f.wait is not None
    assert 0.015 < f.wait[1] < f.span[1] and 0.025 < f.busy[1] < f.span[1]
    assert f.busy[0] == f.wait[0] == 0.0
    got = _samples(families(f))
    assert got["mgserve_pipeline_stage_wait_seconds_total", ("1",)] == f.wait[1]
    assert ("mgserve_pipeline_link_seconds_total", ("0-1",)) not in got


def test_rank_0_combines_every_ranks_latest_figures() -> None:
    """``Peers.figures``: stage 0 from rank 0's own timing, stage r from rank r's snapshot; the
    overlap is the stages' busy seconds over the longest span."""
    peers = Peers.__new__(Peers)  # no threads: the snapshots are put in by hand
    import threading

    peers.lock, peers.threads = threading.Lock(), []
    row = dict(zip(FIELDS, [5, 4.0, 3.0, 1.0, 0, 0], strict=True))
    peers.latest = {1: torch.tensor(list(row.values()), dtype=torch.float64)}
    own = Figures(5, [2.0, 0.0], [2.5, 2.5], [1000], None, [0.0, 0.0])
    f = peers.figures(own)
    assert f.busy == [2.0, 3.0] and f.span == [2.5, 4.0] and f.wait == [0.0, 1.0]
    assert f.link_bytes == [1000]  # rank 0 sent them; the last rank sends on no link
    got = _samples(families(f))
    assert got["mgserve_pipeline_overlap", ()] == pytest.approx(5.0 / 4.0)
    assert got["mgserve_pipeline_stage_busy_fraction", ("1",)] == pytest.approx(0.75)
    assert summary(f) == "0.80 / 0.75, overlap 1.25"


def test_between_two_points_is_the_steps_in_between() -> None:
    a = Figures(3, [1.0, 2.0], [3.0, 3.0], [10], None, [0.0, 0.5])
    b = Figures(7, [2.5, 4.0], [6.0, 7.0], [40], None, [0.0, 1.5])
    d = between(a, b)
    assert d.steps == 4 and d.busy == [1.5, 2.0] and d.span == [3.0, 4.0]
    assert d.link_bytes == [30] and d.wait == [0.0, 1.0] and d.link_seconds is None


class _Replays:
    """A transport across processes as a replay sees it: this process runs stage 1 and waits
    ``delay`` seconds for its input before each replay."""

    n_stages = 2

    def __init__(self, delay: float) -> None:
        self.delay, self.sent_bytes = delay, [0]

    def runs(self, stage: int) -> bool:
        return stage == 1

    def before_replay(self, io: Any) -> None:
        time.sleep(self.delay)

    def after_replay(self, io: Any) -> None:
        pass


def test_a_replay_across_processes_is_timed_as_the_ranks_stage(tmp_path: Path) -> None:
    """Through a decode graph across processes (``StagedLM.before_replay`` / ``after_replay``):
    the step counts once, its wait is the receive before the replay, its work the replay."""
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.pipeline.staged import StagedLM
    from tests.cuda.test_device_models import _export

    cpu = torch.device("cpu")
    model = load_device_model(GGUFFile(_export("llama", tmp_path)), torch_backend(), cpu, 1, 32)
    staged = StagedLM(model, [(0, 1), (1, model.spec.n_layer)], _Replays(0.02))  # type: ignore[arg-type]
    io = type("IO", (), {"received": [(1, torch.empty(0))]})()
    for _ in range(2):
        staged.before_replay(io)
        time.sleep(0.01)  # the graph's replay
        staged.after_replay(io)
        staged.replayed(1)
    t = staged.timing
    t.settle()
    assert t.steps == 2
    assert 0.035 < t.wait[1] and 0.015 < t.busy[1] < t.wait[1] and t.busy[0] == 0.0
    assert t.span > t.busy[1] + t.wait[1] - 1e-3


def test_a_replay_without_hand_offs_still_counts_its_step(tmp_path: Path) -> None:
    """A graph with no hand-offs to make (no ``before_replay``) still counts its replay once, in
    a staged model across processes as in one process."""
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.pipeline.staged import StagedLM
    from tests.cuda.test_device_models import _export

    cpu = torch.device("cpu")
    model = load_device_model(GGUFFile(_export("llama", tmp_path)), torch_backend(), cpu, 1, 32)
    staged = StagedLM(model, [(0, 1), (1, model.spec.n_layer)], _Replays(0.0))  # type: ignore[arg-type]
    staged.replayed(1)
    staged.replayed(1)
    assert staged.timing.steps == 2


def test_a_follower_whose_last_figures_fail_ends_through_its_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Reporter.close`` with rank 0 gone: the follower's ``fail`` (lockstep's ``_fatal``) gets
    a message naming the rank, not a traceback through torch's teardown."""
    import torch.distributed as dist

    from mgserve.pipeline.stage_stats import Reporter

    def gone(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "send", gone)
    said: list[str] = []
    report = Reporter(StageTiming(2, False, lambda: [0], step_span=True), 1, None, said.append)
    report.close()
    assert said == ["rank 1: its last figures did not go to rank 0 (rank 0 gone?)"]
    with pytest.raises(RuntimeError, match="closed by peer"):
        Reporter(StageTiming(2, False, lambda: [0], step_span=True), 1, None).close()
