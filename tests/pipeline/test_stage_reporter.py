"""pipeline/stage_stats.py: a follower's figures to rank 0. A busy follower (never idle) still
sends a snapshot every ``PERIOD`` (a gloo send's work says it is done only once waited for, so
the reporter must not wait for it to say so); a follower going idle first waits for its stage's
intervals to end on the GPU, so the snapshot holds every step it counts; and between two gloo
processes, rank 0 keeps receiving the figures of a follower idle longer than the group's default
timeout (a server idle for half an hour must not lose its followers' figures, nor its
followers)."""

from __future__ import annotations

import datetime
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mgserve.pipeline import stage_stats, timing
from mgserve.pipeline.stage_stats import FIELDS, Peers, Reporter
from mgserve.pipeline.timing import StageTiming

dist = pytest.importorskip("torch.distributed")


class _LateMark:
    """A GPU event's stand-in: its point is not reached until waited for (the GPU behind)."""

    def __init__(self, gpu: bool) -> None:
        self.t, self.reached = time.perf_counter(), False

    def done(self) -> bool:
        return self.reached

    def wait(self) -> None:
        self.reached = True

    def seconds_since(self, start: Any) -> float:
        return float(self.t - start.t)


class _GlooWork:
    """A gloo send's work: ``is_completed`` stays False until ``wait`` (torch 2.x)."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_busy_follower_sends_every_period_and_an_idle_one_all_it_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timing, "_Mark", _LateMark)
    clock = [100.0]
    monkeypatch.setattr(stage_stats, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    sent: list[tuple[dict[str, float], _GlooWork]] = []

    def isend(buf: torch.Tensor, dst: int, group: Any) -> _GlooWork:
        assert dst == 0
        sent.append((dict(zip(FIELDS, buf.tolist(), strict=True)), _GlooWork()))
        return sent[-1][1]

    monkeypatch.setattr(dist, "isend", isend)
    t = StageTiming(2, True, lambda: [0], step_span=True)
    report = Reporter(t, 1, None)

    def step(at: float, idle: bool) -> None:
        clock[0] = at
        t.begin()
        t.receiving(1)
        time.sleep(0.002)
        t.arrived(0)
        with t.stage(1):
            time.sleep(0.002)
        t.end()
        report.after_step()
        if idle:  # no step came for a while
            report.idle()

    step(100.0, idle=False)  # the first: sent at once, of what has ended (nothing: GPU behind)
    assert len(sent) == 1 and sent[0][0]["busy"] == 0.0
    assert sent[0][0]["steps"] == 0  # none held whole: rank 0's caught_up must not take it
    step(100.0 + stage_stats.PERIOD / 2, idle=False)  # within the period: nothing
    assert len(sent) == 1
    step(100.0 + stage_stats.PERIOD * 1.5, idle=False)  # busy, a period on: the next goes
    assert len(sent) == 2 and sent[0][1].waited and sent[1][0]["steps"] == 0
    step(100.0 + stage_stats.PERIOD * 1.6, idle=True)  # idle: every interval waited for
    assert len(sent) == 3 and sent[1][1].waited
    last = sent[-1][0]
    assert last["steps"] == 4 and last["final"] == 0.0
    assert 0 < 4 * 0.002 <= last["busy"] < last["span"], last
    assert last["wait"] >= 4 * 0.002, last


def test_a_period_sent_at_a_bursts_last_step_is_followed_by_the_idle_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The period's snapshot taken at the last step of a burst, the GPU behind: it holds none of
    the steps, so going idle sends again, every interval waited for (and only once)."""
    monkeypatch.setattr(timing, "_Mark", _LateMark)
    clock = [100.0]
    monkeypatch.setattr(stage_stats, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    sent: list[dict[str, float]] = []

    def isend(buf: torch.Tensor, dst: int, group: Any) -> _GlooWork:
        sent.append(dict(zip(FIELDS, buf.tolist(), strict=True)))
        return _GlooWork()

    monkeypatch.setattr(dist, "isend", isend)
    t = StageTiming(2, True, lambda: [0], step_span=True)
    report = Reporter(t, 1, None)
    for k in range(3):  # the last a period after the first: both send
        clock[0] = 100.0 + k * stage_stats.PERIOD / 2
        t.begin()
        with t.stage(1):
            time.sleep(0.002)
        t.end()
        report.after_step()
    assert len(sent) == 2 and sent[-1]["steps"] == 0 and sent[-1]["busy"] == 0.0
    report.idle()
    assert len(sent) == 3 and sent[-1]["steps"] == 3, sent
    assert 3 * 0.002 <= sent[-1]["busy"] < sent[-1]["span"], sent
    report.idle()  # still idle: nothing new
    assert len(sent) == 3


def _worker(rank: int, port: int, out: str, idle_s: float) -> None:
    from torch.distributed import distributed_c10d

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))  # fmt: skip
    distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=idle_s / 3)  # new groups'
    try:
        grp = stage_stats.group()
        if rank == 0:
            peers = Peers(2, grp)
            closed = peers.close(timeout=30)  # the follower's final ends its thread
            torch.save({"closed": closed, "latest": peers.latest[1]}, out)
        else:
            t = StageTiming(3, False, lambda: [0, 64], step_span=True)  # a middle stage
            report = Reporter(t, 1, grp)
            for k in range(2):
                t.begin()
                with t.stage(1):
                    time.sleep(0.01)
                t.end()
                report.after_step()
                report.idle()
                if k == 0:
                    time.sleep(idle_s)  # idle past the group's default timeout
            report.close()
    finally:
        dist.destroy_process_group()


def test_rank_0_hears_a_follower_idle_past_the_default_timeout(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(port, out, 3.0), nprocs=2, start_method="spawn")
    r = torch.load(out)
    steps, span, busy, _, sent, final = r["latest"].tolist()
    assert r["closed"] and final == 1.0 and steps == 2 and sent == 64, r
    assert 0.02 <= busy <= span, r
