"""``mgserve bench model``'s run: the header, one table row per workload (printed as soon as it
is measured, so a long run shows progress), the optional profile, and ``--record``."""

from __future__ import annotations

import argparse
from typing import Any

from mgserve.bench.model import workloads
from mgserve.bench.model.args import depths, pairs
from mgserve.bench.model.figures import Rates, nominal_peak
from mgserve.bench.model.harness import ModelBench, stage_counts, stage_label
from mgserve.bench.model.profile import (
    bytes_per_token,
    gaps_decode,
    gaps_prefill,
    gaps_served,
    profile_decode,
    profile_prefill,
)
from mgserve.bench.model.served import profile_served


def run(args: argparse.Namespace) -> int:
    import torch

    from mgserve.bench.matvec import _copy_rate
    from mgserve.cuda import runtime

    if args.profile and args.device != "cuda":
        raise ValueError("--profile times the GPU's kernels: it needs --device cuda")
    if args.host_profile:  # before anything is timed
        from mgserve.bench.model.host import check_room

        check_room(max(depths(args.decode) or [0]), args.ctx)
    b = ModelBench(args)
    m = b.model
    gpu, copy = "none (CPU)", None
    if b.device.type == "cuda":
        gpu, copy = runtime.gpu_info().name, _copy_rate(torch)
        where = f"GPU: {gpu}; device-to-device copy {copy:.0f} GB/s (read+write)"
    else:  # the bench's own tests: no GPU, no copy rate
        where = "CPU: the torch backend (a test of the bench: no GPU figures)"
    per_tok = bytes_per_token(m)
    head = [
        where,
        f"model: {b.source}, {m.spec.arch}, {m.spec.n_layer} layers, "
        f"{m.weight_bytes / 1e9:.1f} GB of weights on the GPU, loaded in {b.load_s:.1f} s; "
        f"{per_tok / 1e9:.2f} GB of weights read per decode token",
        f"slots {args.slots} x ctx {args.ctx}, cache {args.cache_type}, ubatch {args.ubatch}, "
        f"int8 {args.int8}, cublas prefill {args.cublas_prefill}, pdl {not args.no_pdl}, "
        f"hgemm {args.hgemm or 'default'}{gemm_kind(b.ops)}, "
        f"graphs {not args.no_graphs}, virtual stages {args.virtual_stages}"
        f"{f' (links {args.link_gbps} GB/s)' if args.link_gbps else ''}"
        f"{' (buckets 1, 2, 4, 8, 16)' if args.pow2_buckets else ''}, "
        f"depth fill {args.fill}"
        f"{f', moe tiles {args.moe_tiles}' if args.moe_tiles else ''}"
        f"{''.join(f', set {x}' for x in args.set)}",
        "",
        "| workload | tokens/s | notes |",
        "| --- | --- | --- |",
    ]
    lines = list(head)
    rows: list[dict[str, object]] = []

    def row(name: str, tps: float, note: str = "", **what: object) -> None:
        """One workload: a table line now, and ``what`` it was (kind, sessions, depth, tokens,
        ms) for ``--json``."""
        lines.append(f"| {name}{at} | {tps:.1f} | {note} |")
        rows.append({"workload": name, "tokens_per_s": tps, "stages": b.n_stages,
                     "micro_batches": b.micro, **what})  # fmt: skip
        print(lines[-1], flush=True)

    print("\n".join(head), flush=True)
    counts = stage_counts(args)
    if args.paired:
        from mgserve.bench.model.paired import paired_report

        at = ""
        paired_report(b, args, counts, row, lines)
        counts = []  # every workload ran in rounds
    elif args.toggle:
        raise ValueError("--toggle needs --paired R (the rounds it is timed in)")
    for n_stages, micro in counts:
        if (n_stages, micro) != (b.n_stages, b.micro):
            b.use_stages(n_stages, micro)
        shown = len(counts) > 1 or n_stages > 1 or micro > 1
        at = f" ({stage_label(n_stages, micro)})" if shown else ""
        for n, depth in pairs(args.prefill):
            tps, note = workloads.time_prefill(b, n, depth, args.prefill_repeat)
            row(f"prefill {n} tokens at depth {depth}", tps, note, kind="prefill", sessions=1,
                depth=depth)  # fmt: skip
        if args.long_prefill:
            row(
                f"prefill of a {args.long_prefill}-token prompt (average)",
                workloads.time_prefill(b, args.long_prefill, 0)[0],
                kind="prompt",
                sessions=1,
                tokens=args.long_prefill,
            )
        for sessions, n in pairs(args.multi_prefill):
            row(
                f"prefill, {sessions} sessions of {n} tokens, aggregate",
                workloads.time_multi_prefill(b, sessions, n),
                kind="prompt",
                sessions=sessions,
                tokens=n,
            )
        for sessions, n in pairs(args.sampled_prefill):
            tps, note = workloads.time_sampled_prefill(b, sessions, n)
            what = "a prompt" if sessions == 1 else f"{sessions} sessions' prompts"
            row(f"prefill of {what} of {n} tokens (estimate)", tps, note, kind="prompt",
                sessions=sessions, tokens=n, estimate=True)  # fmt: skip
        for depth in depths(args.decode):
            tps, ms = workloads.time_decode(b, 1, depth)
            alone = workloads.gpu_alone_ms(b, 1)
            row(
                f"decode, 1 session at depth {depth}",
                tps,
                f"{ms:.2f} ms/step, weights {per_tok / ms / 1e6:.0f} GB/s"
                + workloads.alone_note(alone, ms),
                kind="decode",
                sessions=1,
                depth=depth,
                ms=ms,
                gpu_ms=alone,
            )
        for sessions, depth in pairs(args.multi_decode):
            tps, ms = workloads.time_decode(b, sessions, depth)
            alone = workloads.gpu_alone_ms(b, sessions)
            row(
                f"decode, {sessions} sessions at depth {depth}, aggregate",
                tps,
                f"{ms:.2f} ms/step" + workloads.alone_note(alone, ms),
                kind="decode",
                sessions=sessions,
                depth=depth,
                ms=ms,
                gpu_ms=alone,
            )
        if n_stages > 1:
            lines.append(stage_figures(b.runner.model))
            print(lines[-1], flush=True)
    if args.profile:
        depth = max(depths(args.decode) or [0])
        lines += [""] + profile_decode(b, depth)
        lines += [""] + profile_served(b, depth)
        for sessions, mdepth in pairs(args.multi_decode)[:1]:
            lines += [""] + profile_decode(b, mdepth, sessions)
            lines += [""] + profile_served(b, mdepth, sessions)
        lines += [""] + profile_prefill(b, args.ubatch, 0)
    if args.gaps:
        rates = Rates(copy, nominal_peak(gpu))  # the floors of the operations tables
        lines += [""] + gaps_prefill(b, args.ubatch, 0, rates)
        lines += [""] + gaps_decode(b, max(depths(args.decode) or [0]), rates)
        lines += [""] + gaps_served(b, max(depths(args.decode) or [0]))
    if args.host_profile:
        from mgserve.bench.model.host import host_profile

        lines += [""] + host_profile(b, max(depths(args.decode) or [0]))
    body = "\n".join(lines)
    print(body)
    if args.json:
        import json
        from pathlib import Path

        meta = {
            "gpu": gpu,
            "model": b.source,
            "arch": m.spec.arch,
            "int8": args.int8,
            "cublas_prefill": args.cublas_prefill,
            "pdl": not args.no_pdl,
            "moe_tiles": args.moe_tiles,
            "set": list(args.set),
        }
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    if args.record:
        from mgserve.bench import record

        record(f"model on the GPU ({m.spec.arch})", body)
    return 0


def stage_figures(staged: object, which: str = "") -> str:
    """A staged model's timing (pipeline/timing.py) over the steps run without a graph: each
    stage's busy fraction of the steps' spans, and each link's hand-off ms per step."""
    t = staged.timing  # type: ignore[attr-defined]
    t.settle()  # the intervals whose events have completed
    f = t.figures()
    busy, overlap = ", ".join(f"{x:.2f}" for x in f.fractions()), f.overlap()
    n = max(t.steps, 1)
    links = ", ".join(f"{s / n * 1e3:.2f}" for s in t.link)
    return (
        f"|  ({which}stages' busy fraction of eager steps: {busy}, together {overlap:.2f}; "
        f"hand-off ms per step: {links}; {t.steps} steps) | | |"
    )


def gemm_kind(ops: Any) -> str:
    """ ", prompt GEMMs on wgmma" (or which of them) where the GPU's prompt GEMMs run on warpgroup
    MMA (cuda/ops/wgmma.py); "" on the CPU or with none."""
    linear = getattr(ops, "linear", None)
    on = [n for n in ("hgemm", "qgemm") if getattr(getattr(linear, n, None), "wgmma", False)]
    if not on:
        return ""
    return ", prompt GEMMs on wgmma" if len(on) == 2 else f", {on[0]} on wgmma"
