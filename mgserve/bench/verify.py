"""What a speculation verify step costs against a plain decode step: ``mgserve bench verify``.

On the model ``mgserve bench model`` loads (``--model`` or a synthetic ``--shape``), one session
filled to each depth of ``--depths`` (synthetic fill). A plain decode step is one row; a verify
step with k drafts is 1 + k rows of the same slot at consecutive positions (cuda/runner.py), for
each k of ``--drafts``. Both are timed as the median of ``--steps`` steps after warm-up (graph
capture). For a runner that verifies drafts (``supports_drafts``: every device runner now; a
recurrent model's verify step includes its rollback, cuda/verify.py, as drafts of random tokens
are mostly rejected) the steps are whole runner steps (forward, sampling of every row, the one
sync); otherwise only the decode forward (the graph replay) is timed, for both, and the table
says so. Its rows are the figures the speculator's gate needs (spec/gate.py).

The ceiling column is the tokens/s if every draft were accepted: (1 + k) / verify step. Then, for
a runner that verifies drafts, ``--forced`` runs forced acceptance for real: the model's own greedy
continuation of ``--forced-tokens`` tokens, replayed as drafts k at a time, must give the same
tokens, at the tokens/s shown against plain decode of the same continuation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mgserve.bench.model.args import add_model_arguments, depths
from mgserve.bench.model.harness import ModelBench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--depths", default="4096,131072,250000", help="session depths")
    parser.add_argument("--drafts", default="4,8,16,48", help="draft counts k")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per row")
    parser.add_argument("--forced", default="8,16", help="k of the forced-acceptance runs")
    parser.add_argument("--forced-tokens", type=int, default=128, help="forced run's tokens")
    parser.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic")


def _timed(b: ModelBench, step: Any, n: int) -> float:
    """Median seconds of ``step(i)`` over ``n`` calls after 3 untimed ones."""
    times = []
    for i in range(n + 3):
        b.sync()
        t0 = time.perf_counter()
        step(i)
        b.sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_fn(b: ModelBench, depth: int, k: int, whole: bool) -> Any:
    """A step of 1 + k rows of slot 0 at ``depth`` (+ i: each step a token further)."""
    from mgserve.core.engine.contract import SamplingParams, SeqWork
    from mgserve.cuda.graphs import DecodeInputs

    toks = b.tokens(k + 1, 5)
    greedy = SamplingParams(temperature=0.0)

    def whole_step(i: int) -> None:
        b.run_step([SeqWork(0, "bench-0", toks, depth + i, True, greedy, n_draft=k)])

    def forward(i: int) -> None:
        pos = [depth + i + j for j in range(k + 1)]
        inp = DecodeInputs(list(toks), pos, [0] * (k + 1))
        with b.model.backend.path.step("decode"):
            b.runner.decode(inp)

    return whole_step if whole else forward


def cost_table(b: ModelBench, ds: list[int], ks: list[int], steps: int) -> tuple[str, bool]:
    whole = bool(b.runner.supports_drafts)
    lines = [
        "| depth | k | plain step ms | verify step ms | verify / plain | ceiling t/s | plain t/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for depth in ds:
        b.fill(0, depth)
        d = max(depth, 1)  # decode from position 1 at least (0 starts a sequence)
        if depth == 0:
            b.run_step([b.work(0, b.tokens(1, 3), 0, True)])
        plain = _timed(b, _step_fn(b, d, 0, whole), steps)
        for k in ks:
            t = _timed(b, _step_fn(b, d, k, whole), steps)
            lines.append(
                f"| {d} | {k} | {plain * 1e3:.2f} | {t * 1e3:.2f} | {t / plain:.2f} "
                f"| {(1 + k) / t:.1f} | {1 / plain:.1f} |"
            )
    return "\n".join(lines), whole


def forced(b: ModelBench, ks: list[int], n: int) -> str:
    """Plain greedy decode of ``n`` tokens, then the same continuation replayed as drafts."""
    from mgserve.core.engine.contract import SamplingParams, SeqWork

    greedy = SamplingParams(temperature=0.0)
    prompt = b.tokens(64, 17)

    def generate(k: int, drafts: list[int]) -> tuple[list[int], float]:
        (r,) = b.run_step([SeqWork(0, "f", prompt, 0, True, greedy, new_sequence=True)]).results
        out, start = [r.token], len(prompt)
        b.sync()
        t0 = time.perf_counter()
        while len(out) < n:
            d = drafts[len(out) : len(out) + min(k, n - len(out) - 1)]
            w = SeqWork(0, "f", (out[-1], *d), start, True, greedy, n_draft=len(d))
            res = b.run_step([w]).results
            out += [x.token for x in res]
            start += len(res)
        b.sync()
        return out, (n - 1) / (time.perf_counter() - t0)

    plain, plain_tps = generate(0, [])
    lines = ["| k | tokens/s | plain decode t/s | speed-up | same tokens |", "| --- " * 5 + "|"]
    for k in ks:
        out, tps = generate(k, plain)
        same = "yes" if out == plain else "NO"
        lines.append(f"| {k} | {tps:.1f} | {plain_tps:.1f} | {tps / plain_tps:.2f} | {same} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    ds, ks = depths(args.depths), depths(args.drafts)
    if max(ds) + max(ks) + args.steps + 8 > args.ctx:
        raise ValueError(f"--ctx {args.ctx} is too short for depth {max(ds)} and the steps")
    b = ModelBench(args)
    table, whole = cost_table(b, ds, ks, args.steps)
    timed = "whole runner steps" if whole else "the decode forward only (graph replay)"
    out = f"{b.where()}; {b.source}; timed: {timed}\n\n{table}"
    if whole and args.forced:
        out += "\n\nforced acceptance (the greedy continuation replayed as drafts):\n\n"
        out += forced(b, depths(args.forced), args.forced_tokens)
    print(out)
    if args.record:
        from mgserve.bench import record

        record("speculation: verify step cost against plain decode", out)
    return 0 if "| NO |" not in out else 1
