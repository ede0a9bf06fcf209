"""``mgserve bench pipeline-dist``'s table: each run's prefill and decode against the first run,
its stages' busy fractions and overlap in each phase, and what the pipeline model
(pipeline/perfmodel.py ``check_run``) predicts from the run's own stage times, the links and
the host taken as free (a decode step's stage times are not measured through CUDA graphs: "-")."""

from __future__ import annotations

import argparse
from typing import Any


def table(args: argparse.Namespace, results: list[tuple[str, dict[str, Any]]]) -> str:
    base = results[0][1]
    model = args.shape and f"synthetic {args.shape}, {args.layers} layers, {args.experts} experts"
    link = ""
    if args.device == "cuda":
        link = f", {args.dist_backend} backend" + (", NCCL without peer copies" * args.no_p2p)
    lines = [
        f"model `{model or args.model or 'built-in default'}` on {args.device}{link}; prompt "
        f"{args.prompt} tokens in chunks of {args.ubatch}; {args.sessions} sessions decoding at "
        f"depth {args.decode_depth}, {args.decode_steps} steps; greedy",
        "",
        "| run | layers per stage | prefill t/s | TTFT s | decode t/s (aggregate) | ms/step | vs "
        "first run: prefill / decode | stages busy: prefill; decode | model from the stages' "
        "times: prefill t/s / ms/step | tokens as the first run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results:
        stages = " / ".join(f"{a}-{b - 1}" for a, b in r["ranges"])
        same = "yes" if r["tokens"] == base["tokens"] else "**no**"
        tps, step_s = r["model"]
        predicted = f"{tps:.1f} / " + (f"{step_s * 1e3:.1f}" if step_s > 0 else "-")
        lines.append(
            f"| {name} | {stages} | {r['prefill']:.1f} | {r['ttft']:.2f} | "
            f"{r['decode']:.1f} | {r['step_ms']:.1f} | {r['prefill'] / base['prefill']:.2f}x / "
            f"{r['decode'] / base['decode']:.2f}x | {'; '.join(r['stages'])} | {predicted} | "
            f"{same} |"
        )
    return "\n".join(lines)
