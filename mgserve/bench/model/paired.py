"""``mgserve bench model --virtual-stages 1,6 --paired R``: the pipeline machinery's overhead
measured side by side. Every stage count's runner is built once and kept (they share the
model's weights and pools); each workload then runs R rounds, and in each round once on every
runner in turn. A row gives the median of a runner's R runs and, for each runner after the
first, the median and range of its ratio to the first runner *in the same round*, so drift in
the card's clocks or the host between rounds cancels out of the comparison."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from mgserve.bench.model import workloads
from mgserve.bench.model.args import depths, pairs
from mgserve.bench.model.harness import ModelBench

Row = Callable[..., None]


def build_runners(b: ModelBench, counts: list[tuple[int, int]]) -> None:
    """One kept runner per (stages, micro-batches), warmed up."""
    if len(set(counts)) != len(counts) or len(counts) < 2:
        raise ValueError("--paired needs two or more different --virtual-stages, e.g. 1,6")
    for n, micro in counts:
        if (n, micro) != (b.n_stages, b.micro):
            b.use_stages(n, micro, keep=True)


def run_paired(b: ModelBench, args: argparse.Namespace, counts: list[tuple[int, int]],
               row: Row) -> None:  # fmt: skip
    """Every workload of ``args`` in ``args.paired`` rounds over the runners of ``counts``."""
    rounds = args.paired
    if rounds < 1:
        raise ValueError(f"--paired must be at least 1 round, got {rounds}")
    build_runners(b, counts)

    def measure(name: str, once: Callable[[], tuple[float, str]], **what: object) -> None:
        rates: dict[tuple[int, int], list[float]] = {c: [] for c in counts}
        notes: dict[tuple[int, int], str] = {}
        for _ in range(rounds):
            for c in counts:
                b.switch(*c)
                tps, notes[c] = once()
                rates[c].append(tps)
        for c in counts:
            b.switch(*c)
            r = rates[c]
            note = f"median of {rounds}: {min(r):.1f} to {max(r):.1f}"
            if c != counts[0]:
                ratio = [x / y - 1 for x, y in zip(r, rates[counts[0]], strict=True)]
                note += (f"; against {label(counts[0])} in the same round "
                         f"{100 * statistics.median(ratio):+.1f}% "
                         f"({100 * min(ratio):+.1f}% to {100 * max(ratio):+.1f}%)")  # fmt: skip
            elif notes[c]:
                note += f"; {notes[c]}"
            row(f"{name} ({label(c)})", statistics.median(r), note, **what)

    for n, depth in pairs(args.prefill):
        measure(f"prefill {n} tokens at depth {depth}",
                lambda n=n, depth=depth: workloads.time_prefill(b, n, depth),  # type: ignore[misc]
                kind="prefill", sessions=1, depth=depth)  # fmt: skip
    decodes = [(1, d) for d in depths(args.decode)] + pairs(args.multi_decode)
    for sessions, depth in decodes:

        def once(sessions: int = sessions, depth: int = depth) -> tuple[float, str]:
            tps, ms = workloads.time_decode(b, sessions, depth)
            return tps, f"{ms:.2f} ms/step"

        what = "1 session" if sessions == 1 else f"{sessions} sessions"
        agg = ", aggregate" if sessions > 1 else ""
        measure(f"decode, {what} at depth {depth}{agg}", once, kind="decode",
                sessions=sessions, depth=depth)  # fmt: skip


def label(c: tuple[int, int]) -> str:
    n, micro = c
    return f"{n} virtual stages" + (f", {micro} micro-batches" if micro > 1 else "")
