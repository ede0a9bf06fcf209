"""Per-stage figures of a layer pipeline: how busy each stage is, what its links carry and how
long a hand-off takes, and the bubbles (the share of a step a stage waits).

``StageTiming`` records intervals of a step: each stage's work (``stage``) and each link's
hand-off, from the sender's last kernel to the receiver having the data (``link``). On a GPU an
interval is a pair of CUDA events recorded on the stream doing the work; a pair is read only once
its end event has completed (``Event.query``), at the next step, so the steps never wait for the
GPU (a scrape reads what the steps have settled; only a follower that goes idle waits for its
last intervals, stage_stats.py). On the CPU it is the clock. A step's span runs
from its start to its last stage's end; a stage's busy fraction is its busy seconds over the
steps' spans, its bubble fraction the rest; their busy seconds together over the spans are the
stages' overlap (1: one stage at a time). ``families`` gives them as Prometheus metrics
(``mgserve_pipeline_*``), which /metrics shows for a staged model (``--virtual-stages``).

Across processes (``step_span``: the stages' clocks are not one) a rank times its own stage: its
span is a step's start to the step's end on that rank (its logits in hand, or its hand-off sent),
and instead of a link's seconds it records how long its stage waited for its input (``wait``:
from asking for the hand-off to having it, the sender's compute included). Rank 0 gathers the
other ranks' figures (stage_stats.py); the overlap is then the stages' busy seconds over the
longest of their spans.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric


class _Mark:
    """A point in a step: a CUDA event on the current stream, or the clock."""

    def __init__(self, gpu: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if gpu else None
        if self.event is not None:
            self.event.record()
        self.t = time.perf_counter()

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def seconds_since(self, start: _Mark) -> float:
        if self.event is None or start.event is None:
            return self.t - start.t
        return float(start.event.elapsed_time(self.event)) / 1000.0


class Figures(NamedTuple):
    """A pipeline's per-stage figures so far (``families`` shows them)."""

    steps: int  # steps through the stages (rank 0's, across processes)
    busy: list[float]  # seconds each stage computed
    span: list[float]  # seconds of the steps each stage's busy share is of
    link_bytes: list[int]  # bytes handed from stage i to i + 1
    link_seconds: list[float] | None  # a hand-off's seconds per link (one clock only), else None
    wait: list[float] | None  # seconds each stage waited for its input (across processes)

    def fractions(self) -> list[float]:
        """Each stage's busy seconds over its span (0 before any span)."""
        return [b / s if s > 0 else 0.0 for b, s in zip(self.busy, self.span, strict=True)]

    def overlap(self) -> float:
        """The stages' busy seconds over the longest span: 1 when they take turns, up to the
        stage count when all compute at once."""
        longest = max(self.span, default=0.0)
        return sum(self.busy) / longest if longest > 0 else 0.0


class StageTiming:
    def __init__(
        self, n_stages: int, gpu: bool, link_bytes: Callable[[], list[int]],
        step_span: bool = False,
    ) -> None:  # fmt: skip
        self.n_stages, self.gpu = n_stages, gpu
        self._link_bytes = link_bytes  # the transport's bytes per link
        self.step_span = step_span  # a span ends at ``end`` (this rank's), not the last stage
        self.steps = 0
        self.span = 0.0  # seconds of the steps read so far, start to last stage end
        self.busy = [0.0] * n_stages
        self.link = [0.0] * max(n_stages - 1, 0)
        self.wait = [0.0] * n_stages  # seconds a stage waited for its input (``receiving``)
        self._pending: list[tuple[str, int, _Mark, _Mark]] = []  # (kind, index, start, end)
        self._begin: _Mark | None = None
        self._last_start: dict[int, _Mark] = {}
        self._asked: dict[int, _Mark] = {}
        self._started: dict[int, _Mark] = {}

    def begin(self) -> None:
        self.settle()
        self._begin = _Mark(self.gpu)
        self.steps += 1

    @contextlib.contextmanager
    def stage(self, i: int, final: bool = True) -> Iterator[None]:
        """``stage``'s work (on its stream, where ``Transport.on`` put it); ``final``: the step's
        last micro-batch (the last stage's end of it ends the step's span)."""
        self.start(i)
        yield
        end = self.stop(i)
        last = final and i == self.n_stages - 1 and not self.step_span
        if last and self._begin is not None:
            self._pending.append(("span", 0, self._begin, end))

    def start(self, i: int) -> None:
        """Stage ``i``'s work starts (``stage``; a graph's replay across processes)."""
        self._started[i] = _Mark(self.gpu)

    def stop(self, i: int) -> _Mark:
        """Stage ``i``'s work since ``start`` is done."""
        end = _Mark(self.gpu)
        self._pending.append(("stage", i, self._started.pop(i), end))
        return end

    def end(self) -> None:
        """The step is done on this rank (``step_span``: its span ends here)."""
        if self.step_span and self._begin is not None:
            self._pending.append(("span", 0, self._begin, _Mark(self.gpu)))
            self._begin = None

    def sent(self, link: int) -> None:
        """Stage ``link`` has issued its last kernel: the hand-off on ``link`` starts."""
        self._last_start[link] = _Mark(self.gpu)

    def receiving(self, stage: int) -> None:
        """``stage`` asks for its input; where the sender is another process (no ``sent`` here),
        the wait until ``arrived`` is the stage's."""
        if stage - 1 not in self._last_start:
            self._asked[stage] = _Mark(self.gpu)

    def arrived(self, link: int) -> None:
        """The receiving stage has the hand-off (after ``Transport.recv``, on its stream)."""
        start = self._last_start.pop(link, None)
        if start is not None:
            self._pending.append(("link", link, start, _Mark(self.gpu)))
        elif (asked := self._asked.pop(link + 1, None)) is not None:
            self._pending.append(("wait", link + 1, asked, _Mark(self.gpu)))

    def settle(self, wait: bool = False) -> None:
        """Add the intervals whose end has completed (the others wait for a later look; with
        ``wait``, every interval: its end is waited for, as a follower does when it goes idle,
        stage_stats.py). Only the thread that runs the steps calls it (``begin``): a query of a
        CUDA event from another thread while that one captures a graph would break the capture."""
        left = []
        for kind, i, start, end in self._pending:
            if wait:
                end.wait()
            if not end.done():
                left.append((kind, i, start, end))
                continue
            s = end.seconds_since(start)
            if kind == "stage":
                self.busy[i] += s
            elif kind == "link":
                self.link[i] += s
            elif kind == "wait":
                self.wait[i] += s
            else:
                self.span += s
        self._pending = left

    def measured(self) -> int:
        """The steps whose intervals have all been read (``settle``): ``steps`` less those with
        one still pending (across processes each step has a span, ended last: ``end``)."""
        spans = sum(1 for kind, *_ in self._pending if kind == "span")
        return self.steps - max(spans, 1 if self._pending else 0)

    def figures(self) -> Figures:
        """What this process has measured (no CUDA call: a scrape's thread may run beside a
        capture; ``settle`` runs on the steps' thread)."""
        return Figures(
            self.steps, list(self.busy), [self.span] * self.n_stages, self._link_bytes(),
            None if self.step_span else list(self.link),
            list(self.wait) if self.step_span else None,
        )  # fmt: skip

    def families(self) -> Iterator[Metric]:
        return families(self.figures())


def families(f: Figures) -> Iterator[Metric]:
    """``f`` as Prometheus metric families (``mgserve_pipeline_*``)."""
    yield CounterMetricFamily(
        "mgserve_pipeline_steps", "steps through the pipeline's stages", value=f.steps
    )
    busy = CounterMetricFamily(
        "mgserve_pipeline_stage_busy_seconds", "seconds a stage computed", labels=["stage"]
    )
    frac = GaugeMetricFamily(
        "mgserve_pipeline_stage_busy_fraction",
        "a stage's busy seconds over the steps' spans (1 - its bubble fraction)",
        labels=["stage"],
    )
    bubble = GaugeMetricFamily(
        "mgserve_pipeline_bubble_fraction",
        "the share of the steps' spans a stage waited",
        labels=["stage"],
    )
    yield GaugeMetricFamily(
        "mgserve_pipeline_overlap",
        "the stages' busy seconds over the steps' spans (the longest stage's, across processes): "
        "1 when they take turns, up to the stage count when all compute at once",
        value=f.overlap(),
    )
    for i, (b, s, x) in enumerate(zip(f.busy, f.span, f.fractions(), strict=True)):
        busy.add_metric([str(i)], b)
        frac.add_metric([str(i)], x)
        bubble.add_metric([str(i)], 1.0 - x if s > 0 else 0.0)
    links = CounterMetricFamily(
        "mgserve_pipeline_link_bytes", "bytes handed from stage i to i + 1", labels=["link"]
    )
    for i, n in enumerate(f.link_bytes):
        links.add_metric([f"{i}-{i + 1}"], n)
    yield from (busy, frac, bubble, links)
    if f.link_seconds is not None:
        secs = CounterMetricFamily(
            "mgserve_pipeline_link_seconds",
            "seconds from a stage's last kernel to the next stage having its hand-off",
            labels=["link"],
        )
        for i, s in enumerate(f.link_seconds):
            secs.add_metric([f"{i}-{i + 1}"], s)
        yield secs
    if f.wait is not None:
        wait = CounterMetricFamily(
            "mgserve_pipeline_stage_wait_seconds",
            "seconds a stage waited for its input from the stage before (across processes: "
            "the sender's compute and the transfer)",
            labels=["stage"],
        )
        for i, s in enumerate(f.wait):
            wait.add_metric([str(i)], s)
        yield wait
