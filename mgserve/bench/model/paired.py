"""``mgserve bench model --paired R``: two or more variants of one loaded model measured side by
side. The variants are either stage counts (``--virtual-stages 1,6``: every count's runner is
built once and kept; they share the model's weights and pools), an op family's switch on and
off (``--toggle qsa.prefill_kernels``: a boolean attribute of ``ModelBench.ops``; ``gc.freeze``
the heap frozen or not) or a setting at several values (``--toggle qsa.score_group=64/256``;
``ubatch=2048/4096/8192``: the prompt chunk's tokens, the bench's own ``--ubatch``), or the MoE
prompt kernels' tilings (``--moe-tiles A/B``). Each variant
runs every workload once untimed first (its kernels compiled, its buffers sized); then each
workload runs R rounds, and in each round once on every variant in turn, round r starting at
variant r mod V (a variant run first in every round would take any first-in-round cost alone:
caches, clocks, what the workload before left behind). A row gives the median
of a variant's R runs and, for each variant after the first, the median and range of its ratio
to the first variant *in the same round*, so drift in the card's clocks or the host between
rounds cancels out of the comparison."""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable
from typing import Any

from mgserve.bench.model import workloads
from mgserve.bench.model.args import depths, pairs
from mgserve.bench.model.harness import ModelBench, freeze_heap, stage_label, switch_owner
from mgserve.bench.model.tiles import moe_tilings, set_moe_tiles, tiling_label

Row = Callable[..., None]
Variant = tuple[str, Callable[[], None]]  # (label, make it the current one)


def stage_variants(b: ModelBench, counts: list[tuple[int, int]]) -> list[Variant]:
    """One kept runner per (stages, micro-batches), warmed up."""
    if len(set(counts)) != len(counts) or len(counts) < 2:
        raise ValueError("--paired needs two or more different --virtual-stages, e.g. 1,6")
    for n, micro in counts:
        if (n, micro) != (b.n_stages, b.micro):
            b.use_stages(n, micro, keep=True)
    return [(stage_label(*c), lambda c=c: b.switch(*c)) for c in counts]  # type: ignore[misc]


def toggle_variants(b: ModelBench, name: str) -> tuple[list[Variant], Callable[[], None]]:
    """``family.attribute`` of the bench's backend on, then off (it must be a bool), and what
    puts its value back as it was; ``gc.freeze``: the objects alive out of the garbage
    collector's sight (harness.warm_up, api/app.py), then back in it."""
    if name == "gc.freeze":  # the process's heap frozen as the server freezes it, or not

        def thaw() -> None:  # as freeze_heap, a full collection first: only the freeze differs
            gc.unfreeze()
            gc.collect()

        frozen = gc.get_freeze_count() > 0
        return [("gc.freeze on", freeze_heap), ("gc.freeze off", thaw)], (
            freeze_heap if frozen else thaw
        )
    if name.startswith("ubatch="):
        return chunk_variants(b, name)
    if "=" in name:
        return value_variants(b, name)
    owners = []  # a+b: several switches turned on and off together
    for one in name.split("+"):
        fam, attr = switch_owner(b.ops, one)
        if fam is None or not isinstance(getattr(fam, attr, None), bool):
            raise ValueError(
                f"--toggle {name!r}: {one!r} is not a boolean switch of an op family (e.g. "
                "qsa.prefill_kernels, deltanet.prefill_kernels, linear.hgemm.wgmma; several "
                "together: a+b; an int or float setting takes its values: qsa.score_group=64/256)"
            )
        owners.append((fam, attr, getattr(fam, attr)))

    def put(on: bool | None) -> None:  # None: each as it was
        for fam, attr, was in owners:
            setattr(fam, attr, was if on is None else on)

    variants: list[Variant] = [
        (f"{name} {word}", lambda on=on: put(on))  # type: ignore[misc]
        for word, on in (("on", True), ("off", False))
    ]
    return variants, lambda: put(None)


def value_variants(b: ModelBench, text: str) -> tuple[list[Variant], Callable[[], None]]:
    """``family.attribute=A/B/...``: an int or float setting of the bench's backend at each
    value in turn (the first is the one the others are compared with), and what puts it back."""
    name, _, values = text.partition("=")
    fam, attr = switch_owner(b.ops, name)
    was = getattr(fam, attr, None) if fam is not None and attr else None
    if isinstance(was, bool) or not isinstance(was, (int, float)):
        raise ValueError(
            f"--toggle {text!r}: {name!r} is not an int or float setting of an op family "
            "(e.g. qsa.score_group=64/256, route.split_tokens=1/2)"
        )
    try:
        parsed = [type(was)(v) for v in values.split("/")]
    except ValueError:
        raise ValueError(f"--toggle {text!r}: the values are not {type(was).__name__}s") from None
    if len(parsed) < 2 or len(set(parsed)) < len(parsed):
        raise ValueError(f"--toggle {text!r}: two or more different values, A/B")
    variants: list[Variant] = [
        (f"{name}={v}", lambda v=v: setattr(fam, attr, v))  # type: ignore[misc]
        for v in parsed
    ]
    return variants, lambda: setattr(fam, attr, was)


def chunk_variants(b: ModelBench, text: str) -> tuple[list[Variant], Callable[[], None]]:
    """``ubatch=A/B/...``: the prompt cut into chunks of A tokens, then of B, ... (``--ubatch``,
    which the server's ``--batch-size`` is), and what puts it back."""
    was = b.args.ubatch
    try:
        sizes = [int(v) for v in text.partition("=")[2].split("/")]
    except ValueError:
        raise ValueError(f"--toggle {text!r}: the chunk sizes are not integers") from None
    if len(sizes) < 2 or len(set(sizes)) < len(sizes) or min(sizes) < 1:
        raise ValueError(f"--toggle {text!r}: two or more different chunk sizes, A/B")
    variants: list[Variant] = [
        (f"ubatch {n}", lambda n=n: setattr(b.args, "ubatch", n))  # type: ignore[misc]
        for n in sizes
    ]
    return variants, lambda: setattr(b.args, "ubatch", was)


def tile_variants(b: ModelBench, text: str) -> list[Variant]:
    """``--moe-tiles A/B/...``: the MoE prompt kernels under each tiling (qgemm.cu's
    QGemmTuning, or with ``wg:`` their wgmma twins' QWgmmaTuning), the first current after."""
    tunings = moe_tilings(text)
    if len(tunings) < 2:
        raise ValueError(f"--paired with --moe-tiles needs two or more tilings, got {text!r}")
    linear: Any = b.ops.linear  # LinearCuda: the bench refuses --moe-tiles on the CPU
    qgemm = linear.qgemm  # qgemm.cu's tilings: ModelBench turned their wgmma twins off
    return [
        (f"moe tiles {tiling_label(t)}", lambda t=t: set_moe_tiles(qgemm, t))  # type: ignore[misc]
        for t in tunings
    ]


def paired_report(b: ModelBench, args: argparse.Namespace, counts: list[tuple[int, int]],
                  row: Row, lines: list[str]) -> None:  # fmt: skip
    """``--paired``: the variants of ``args`` (stage counts, ``--toggle`` or ``--moe-tiles``) in
    rounds, then each staged runner's stage figures (table lines appended to ``lines``); the
    first variant is current after."""
    from mgserve.bench.model.report import stage_figures

    if sum((len(counts) > 1, bool(args.toggle), "/" in args.moe_tiles)) > 1:
        raise ValueError(
            "--paired compares stage counts, a --toggle or --moe-tiles, one of them at a time"
        )
    left_out = {
        "--long-prefill": args.long_prefill,
        "--multi-prefill": args.multi_prefill,
        "--sampled-prefill": args.sampled_prefill,
        "--prefill-repeat": args.prefill_repeat != 1,
    }
    for flag in (f for f, given in left_out.items() if given):
        raise ValueError(f"--paired times --prefill, --decode and --multi-decode only: {flag} "
                         "is not timed in rounds (the rounds are the repeats)")  # fmt: skip
    decodes = depths(args.decode) or pairs(args.multi_decode)
    from mgserve.cuda.graphs import GRAPH_SWITCHES  # a graph is captured per their setting

    switches = args.toggle.partition("=")[0].split("+")
    graphed = ("", "gc.freeze", "ubatch", *GRAPH_SWITCHES)  # (a decode step has no chunk)
    if any(s not in graphed for s in switches) and not args.no_graphs and decodes:
        raise ValueError(
            "--toggle with --decode or --multi-decode: a decode step replays the CUDA graph "
            "captured under the first setting; add --no-graphs, or give --decode= --multi-decode="
        )
    if "/" in args.moe_tiles:
        variants = tile_variants(b, args.moe_tiles)
        run_paired(b, args, variants, row)
        return
    if args.toggle:
        variants, restore = toggle_variants(b, args.toggle)
        run_paired(b, args, variants, row)
        restore()  # the switch as it was: what runs after (--profile, --gaps) is the default
        return
    variants = stage_variants(b, counts)
    run_paired(b, args, variants, row)
    for n, micro in counts:
        if n > 1:  # one stage is the plain model: no stage timing
            b.switch(n, micro)
            lines.append(stage_figures(b.runner.model, f"{stage_label(n, micro)}: "))
            print(lines[-1], flush=True)
    variants[0][1]()


def run_paired(b: ModelBench, args: argparse.Namespace, variants: list[Variant],
               row: Row) -> None:  # fmt: skip
    """Every workload of ``args`` in ``args.paired`` rounds over ``variants``."""
    rounds = args.paired
    if rounds < 1:
        raise ValueError(f"--paired must be at least 1 round, got {rounds}")
    first = variants[0][0]

    def measure(name: str, once: Callable[[], tuple[float, str]], **what: object) -> None:
        rates: dict[str, list[float]] = {v: [] for v, _ in variants}
        notes: dict[str, str] = {}
        for _, use in variants:  # untimed: each variant's kernels compiled, its buffers sized
            use()
            once()
        for i in range(rounds):  # each round starts at the next variant: no order favoured
            k = i % len(variants)
            for v, use in variants[k:] + variants[:k]:
                use()
                tps, notes[v] = once()
                rates[v].append(tps)
        for v, use in variants:
            use()  # the row's stage count (report.row reads the current runner's)
            r = rates[v]
            note = f"median of {rounds}: {min(r):.1f} to {max(r):.1f}"
            extra: dict[str, object] = {}
            if v != first:
                ratio = [x / y - 1 for x, y in zip(r, rates[first], strict=True)]
                mid, lo, hi = statistics.median(ratio), min(ratio), max(ratio)
                extra = {"ratio_median": mid, "ratio_min": lo, "ratio_max": hi}
                note += (f"; against {first} in the same round {100 * mid:+.1f}% "
                         f"({100 * lo:+.1f}% to {100 * hi:+.1f}%)")  # fmt: skip
            elif notes[v]:
                note += f"; {notes[v]}"
            row(f"{name} ({v})", statistics.median(r), note, **what, **extra)
        variants[0][1]()  # the first variant current again

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
