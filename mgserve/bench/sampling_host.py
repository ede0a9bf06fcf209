"""``mgserve bench sampling-host``: the host's sampling inputs of one decode step, on the CPU.

The sampler's inputs are part of the host's work in a decode step: every session's row packed
into a staging buffer (neutral values, then each row's temperature, seed, counter, penalty
window, biases) and copied to the device. The runner does it after launching the step's
forward, so it runs while the GPU computes and lengthens a step only where the host is behind
(many sessions, a slow or busy CPU: the API's threads share the interpreter). This times
one step's inputs for 1..S sessions of the server's default sampling with a 64-token penalty
window, side by side: as served (the lane's kept batch of the rows' size class refilled,
sampling/kept.py) and as before 2026-12-08 (a new batch built every step: a device buffer, a
pinned staging buffer on a GPU and two sets of views). The device copy is the CPU's memcpy here
(a pinned non-blocking copy on a GPU).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from mgserve.bench import median_us

VOCAB = 248320  # qwen4exp's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", default="1,5,16", help="comma-separated session counts")
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timing")


def run(args: argparse.Namespace) -> int:
    from mgserve.bench import record
    from mgserve.core.engine.contract import SamplingParams
    from mgserve.cuda.sampling.inputs import SamplingBatch
    from mgserve.cuda.sampling.kept import kept_batch
    from mgserve.cuda.sampling.plan import SamplingRow

    sessions = [int(x) for x in args.sessions.split(",")]
    if not sessions or min(sessions) < 1:
        raise ValueError(f"--sessions {args.sessions!r}: positive counts, e.g. 1,5,16")
    cpu, kept = torch.device("cpu"), {}  # type: ignore[var-annotated]
    lines = [
        "Sampling inputs of a decode step on the host (default sampling, a 64-token window, "
        f"{VOCAB} tokens); microseconds per step (median of 5 x {args.repeat} calls), side by side",
        "",
        "| sessions | kept batch refilled (as served) | a new batch every step (before) | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for s in sessions:
        rows = [SamplingRow(SamplingParams(seed=i), list(range(100 + i)), 7) for i in range(s)]
        now = median_us(partial(kept_batch, kept, rows, VOCAB, cpu), args.repeat)
        before = median_us(partial(SamplingBatch.build, rows, VOCAB, cpu), args.repeat)
        lines.append(f"| {s} | {now:.1f} | {before:.1f} | {before / now:.2f}x |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.record:
        record("sampling inputs of a decode step on the host (CPU)", "\n".join(lines))
    return 0
