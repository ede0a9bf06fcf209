"""What each kernel adds to a decode step as the runner serves it (``bench model --profile``).

The eager step's table (profile.py) sums each kernel's own duration, which is not what it costs a
served step: there the step is a CUDA graph whose kernels launch early (programmatic dependent
launch: a kernel's prologue, its weights' L2 prefetch, overlaps the kernel before it) and side
chains run beside the main one (ops/branch.py). A kernel's duration then includes the time it
waited for its predecessor, and overlapped work costs nothing.

So this profiles a few served steps and walks their GPU operations in start order, keeping the
frontier (the latest end so far). An operation that ends past the frontier adds the difference to
the step; one that ends before it (overlapped) adds nothing; time with nothing running is idle
(the host's share: sampling, the next step's inputs). The additions and the idle time sum to the
span from the first operation to the last, so the table splits the served step exactly, by the
operation that moved it forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mgserve.bench.model.trace import gpu_ops, trace_events
from mgserve.bench.model.workloads import decoding

WARM_STEPS = 3  # served steps before the profiled ones: the graph captured, buffers sized


@dataclass
class Adds:
    """One operation name's share of a timeline (microseconds)."""

    count: int = 0
    adds: float = 0.0  # how far it moved the frontier
    own: float = 0.0  # its durations summed (overlaps counted)


@dataclass
class Split:
    """A timeline split by the operations that moved it forward."""

    rows: dict[str, Adds] = field(default_factory=dict)
    idle: float = 0.0  # microseconds with no operation running
    span: float = 0.0  # first start to last end


def split_timeline(ops: Iterable[tuple[str, float, float]]) -> Split:
    """``ops`` (name, start, end) of GPU operations -> their ``Split``: each operation adds
    max(0, end - max(start, frontier)) in start order; idle is the time before an operation's
    start past the frontier. Additions plus idle equal the span, by construction."""
    out = Split()
    frontier: float | None = None
    first = 0.0
    for name, start, end in sorted(ops, key=lambda o: (o[1], o[2])):
        if end < start:
            raise ValueError(f"{name}: ends at {end} before it starts at {start}")
        if frontier is None:
            frontier = first = start
        if start > frontier:
            out.idle += start - frontier
            frontier = start
        row = out.rows.setdefault(name, Adds())
        row.count += 1
        row.own += end - start
        row.adds += max(0.0, end - frontier)
        frontier = max(frontier, end)
    out.span = 0.0 if frontier is None else frontier - first
    return out


def split_table(split: Split, what: str, steps: int, top: int = 30) -> list[str]:
    """Table lines of ``split`` per step (``steps`` of them), the largest additions first."""
    per = 1e3 * steps  # microseconds over the steps -> ms a step
    total = sum(r.count for r in split.rows.values())
    lines = [
        f"time each GPU operation adds to {what}, per step: {split.span / per:.3f} ms from the "
        f"first operation to the last, {split.idle / per:.3f} ms of it idle, "
        f"{total / steps:.0f} operations ({steps} steps profiled)",
        "",
        "| operation | per step | adds ms | share | own ms (overlaps counted) |",
        "| --- | --- | --- | --- | --- |",
    ]
    span = split.span or 1.0
    ranked = sorted(split.rows.items(), key=lambda kv: -kv[1].adds)
    for name, r in ranked[:top]:
        lines.append(
            f"| `{name[:60]}` | {r.count / steps:g} | {r.adds / per:.3f} | "
            f"{100 * r.adds / span:.1f}% | {r.own / per:.3f} |"
        )
    rest = ranked[top:]
    if rest:
        adds, own = sum(r.adds for _, r in rest), sum(r.own for _, r in rest)
        lines.append(
            f"| ({len(rest)} others) | {sum(r.count for _, r in rest) / steps:g} | "
            f"{adds / per:.3f} | {100 * adds / span:.1f}% | {own / per:.3f} |"
        )
    return lines


def profile_served(b: Any, depth: int, sessions: int = 1, steps: int = 8) -> list[str]:
    """``steps`` decode steps of ``sessions`` sessions at ``depth`` as the runner serves them
    (CUDA graphs unless ``--no-graphs``), profiled: table lines of ``split_table``."""
    from torch.profiler import ProfilerActivity, profile

    step = decoding(b, sessions, depth)
    for _ in range(WARM_STEPS):
        step()
    b.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        b.sync()
    events = trace_events(p)
    how = "CUDA graphs" if not b.args.no_graphs and b.device.type == "cuda" else "eager"
    who = "1 session" if sessions == 1 else f"{sessions} sessions"
    what = f"a served decode step of {who} at depth {depth} ({how})"
    ops = gpu_ops(events)
    if not ops:
        return [f"time each GPU operation adds to {what}: no GPU operations in the trace"]
    return split_table(split_timeline(ops), what, steps)
