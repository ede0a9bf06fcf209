"""Per-stage figures of a pipeline across processes, in rank 0's /metrics: every rank times its
own stage (timing.py, ``step_span``), and the followers send theirs to rank 0 on a gloo group of
their own, apart from the hand-offs and the steps.

A follower sends a snapshot of its figures (``FIELDS``) after a step at most every ``PERIOD``
seconds, and when no step has come for ``IDLE_AFTER`` seconds and the last snapshot did not
hold every step (the pipeline went idle, so the last figures arrive; then it first waits for its
stage's intervals to end on the GPU: ``settle(wait=True)``). A snapshot counts only the steps it
holds every interval of (``StageTiming.measured``): one taken while the GPU is behind counts
fewer, so rank 0's ``caught_up`` waits for the idle one. Not after every step whose next has
not come yet: in decode that is every step (rank 0 sends the next once it has this one's
logits), and a send and a GPU wait per step would cost.
A send is an ``isend``, one in flight at a time: the next first waits for the one before, sent
a while earlier (a gloo send's work never says it is done until it is waited for), which rank
0's thread, always receiving, has long taken.
Rank 0 receives each follower's in a thread of its own and keeps the latest; a scrape combines
them with its own (``Peers.figures``). The group waits as long as the control group
(rendezvous.py ``IDLE``): a receive of an idle server must not time out, which would end rank
0's thread and break the follower's next send. When rank 0 stops the pipeline, each follower
sends its last figures marked final (``Reporter.close``), which ends rank 0's thread for it;
rank 0 waits for those threads before it leaves the process group (a thread still in a receive
then aborts the process). A follower that died ends its thread with an error; it leaves its
last figures.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mgserve.pipeline.timing import Figures, StageTiming

log = logging.getLogger(__name__)

PERIOD = 1.0  # seconds between a busy follower's snapshots
IDLE_AFTER = 0.05  # seconds without a step after which a follower counts as idle
FIELDS = ("steps", "span", "busy", "wait", "sent_bytes", "final")  # the rank's stage, float64


def group() -> Any:
    """The figures' gloo group; every rank makes it at the same point (after the slots'). Its
    receives wait as long as a server may stay idle (the module docstring)."""
    import torch.distributed as dist

    from mgserve.pipeline.rendezvous import IDLE

    return dist.new_group(backend="gloo", timeout=IDLE)


def snapshot(timing: StageTiming, stage: int, final: bool = False) -> torch.Tensor:
    """``stage``'s figures as this rank has them (``FIELDS``); its steps are those it holds
    every interval of (``measured``), so rank 0's ``caught_up`` waits for a complete one."""
    f = timing.figures()
    sent = f.link_bytes[stage] if stage < len(f.link_bytes) else 0
    wait = f.wait[stage] if f.wait is not None else 0.0
    row = [timing.measured(), f.span[stage], f.busy[stage], wait, sent, float(final)]
    return torch.tensor(row, dtype=torch.float64)


class Reporter:
    """A follower's: its stage's figures to rank 0 (the module docstring)."""

    def __init__(self, timing: StageTiming, stage: int, grp: Any,
                 fail: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.timing, self.stage, self.group = timing, stage, grp
        self.fail = fail  # called where a send fails (rank 0 gone), else the error is raised
        self.work: Any = None
        self.buf: torch.Tensor | None = None  # the snapshot in flight (kept until it completes)
        self.last, self.sent_steps = 0.0, 0  # when the last went, and the steps it held

    def after_step(self) -> None:
        """A step is done: the figures go if a period has passed since the last."""
        if time.monotonic() - self.last >= PERIOD:
            self._send(wait=False)

    def idle(self) -> None:
        """No step came for ``IDLE_AFTER`` seconds: the figures go, every interval ended (this
        is the steps' thread, and the GPU has no next), if the last held fewer steps than came
        (steps since, or a period's snapshot taken while the GPU was behind)."""
        if self.sent_steps != self.timing.steps:
            self._send(wait=True)

    def _send(self, wait: bool) -> None:
        import torch.distributed as dist

        with self._failing("its figures"):
            self._ready(wait)
            self.buf = snapshot(self.timing, self.stage)
            self.work = dist.isend(self.buf, dst=0, group=self.group)
        self.last, self.sent_steps = time.monotonic(), self.timing.measured()

    def close(self) -> None:
        """Rank 0 has stopped the pipeline: the last figures, marked final (the docstring)."""
        import torch.distributed as dist

        with self._failing("its last figures"):
            self._ready(wait=True)
            dist.send(snapshot(self.timing, self.stage, final=True), dst=0, group=self.group)

    def _ready(self, wait: bool) -> None:
        """The send before taken (a while ago: rank 0 has it, the module docstring), and what
        has ended of this rank's intervals read (``wait``: every one, waited for)."""
        if self.work is not None:
            self.work.wait()
        self.timing.settle(wait=wait)

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """A failure inside goes to ``fail`` (rank 0 gone), else it is raised."""
        try:
            yield
        except Exception:
            if self.fail is None:
                raise
            self.fail(f"rank {self.stage}: {what} did not go to rank 0 (rank 0 gone?)")


class Peers:
    """Rank 0's: the latest figures of every other rank, each received in a thread of its own."""

    def __init__(self, world: int, grp: Any) -> None:
        self.lock = threading.Lock()
        self.latest = {r: torch.zeros(len(FIELDS), dtype=torch.float64) for r in range(1, world)}
        self.threads = [
            threading.Thread(target=self._receive, args=(r, grp), daemon=True) for r in self.latest
        ]
        for t in self.threads:
            t.start()

    def _receive(self, rank: int, grp: Any) -> None:
        import torch.distributed as dist

        while True:
            buf = torch.empty(len(FIELDS), dtype=torch.float64)
            try:
                dist.recv(buf, src=rank, group=grp)
            except Exception:  # noqa: BLE001 - the rank or the group is gone: keep its last
                log.debug("rank %d's figures end", rank, exc_info=True)
                return
            with self.lock:
                self.latest[rank] = buf
            if buf[-1]:  # its last (``Reporter.close``)
                return

    def close(self, timeout: float) -> bool:
        """Wait for every follower's last figures (after rank 0's stop); False: some thread
        still receives after ``timeout`` seconds (the process group must not go then)."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def figures(self, own: Figures) -> Figures:
        """Rank 0's own figures (stage 0) with every other rank's stage from its latest."""
        busy, span, sent = list(own.busy), list(own.span), list(own.link_bytes)
        wait = list(own.wait) if own.wait is not None else [0.0] * len(busy)
        with self.lock:
            for r, x in self.latest.items():
                _, span[r], busy[r], wait[r], sent_r, _ = x.tolist()
                if r < len(sent):
                    sent[r] = int(sent_r)
        return Figures(own.steps, busy, span, sent, None, wait)

    def caught_up(self, steps: int, timeout: float) -> bool:
        """Wait until every follower's figures count ``steps`` steps (rank 0's) or more."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                behind = [r for r, x in self.latest.items() if x[0] < steps]
            if not behind or time.monotonic() > end:
                return not behind
            time.sleep(0.01)


def between(a: Figures, b: Figures) -> Figures:
    """The figures of the steps from ``a`` to ``b`` (both taken the same way)."""

    def minus(x: list[Any] | None, y: list[Any] | None) -> list[Any] | None:
        return None if x is None or y is None else [q - p for p, q in zip(x, y, strict=True)]

    return Figures(
        b.steps - a.steps, minus(a.busy, b.busy) or [], minus(a.span, b.span) or [],
        minus(a.link_bytes, b.link_bytes) or [], minus(a.link_seconds, b.link_seconds),
        minus(a.wait, b.wait),
    )  # fmt: skip


def summary(f: Figures) -> str:
    """Each stage's busy fraction and the stages' overlap, e.g. "0.95 / 0.88, overlap 1.71"."""
    pairs = zip(f.fractions(), f.span, strict=True)
    fractions = " / ".join(f"{x:.2f}" if s > 0 else "-" for x, s in pairs)
    return f"{fractions}, overlap {f.overlap():.2f}"


def every_stage(staged: Any, timeout: float = 30.0) -> Figures:
    """Rank 0's figures of every stage once the followers' count its steps (rank 0's thread)."""
    staged.timing.settle()
    if not staged.peers.caught_up(staged.timing.steps, timeout):
        log.warning("a follower's figures lag rank 0's %d steps after %.0f s: they are stale",
                    staged.timing.steps, timeout)  # fmt: skip
    return staged.peers.figures(staged.timing.figures())  # type: ignore[no-any-return]
