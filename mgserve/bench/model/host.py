"""``bench model --host-profile``: where the host's part of a served decode step goes.

A served step is the model's graph plus what surrounds it: the step's inputs built and copied,
the sampler's launches, the wait for the sampled ids, the runner's bookkeeping. The bench rows
give that part as "outside it +X ms" (the served step against the graph replayed alone); this
table splits the host's share by Python function (cProfile over served steps of one session).
cProfile slows Python code (roughly 1.5-2x), so the shares rank the functions; their sum is not
the unprofiled step's. The time the host waits for the GPU shows in the synchronising calls."""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

from mgserve.bench.model.harness import ModelBench
from mgserve.bench.model.workloads import decoding


def _where(file: str, line: int, name: str) -> str:
    if file == "~":  # a builtin: pstats files them under "~"
        return name
    parts = Path(file).parts
    short = "/".join(parts[parts.index("mgserve") :]) if "mgserve" in parts else parts[-1]
    return f"{short}:{line} {name}"


STEPS = 64  # served steps profiled


def check_room(depth: int, ctx: int, steps: int = STEPS) -> None:
    """ValueError unless one session at ``depth`` has room for the warm-up and profiled steps
    in ``ctx`` positions (checked before a run's timed workloads)."""
    if depth + 4 + steps > ctx:
        raise ValueError(
            f"--host-profile decodes {steps + 4} positions past depth {depth}: more than --ctx "
            f"{ctx} holds"
        )


def host_profile(b: ModelBench, depth: int, steps: int = STEPS, top: int = 20) -> list[str]:
    """Table lines: the ``top`` functions by their own time over ``steps`` served decode steps
    of one session at ``depth``, per step."""
    check_room(depth, b.args.ctx, steps)
    step = decoding(b, 1, depth)
    for _ in range(3):  # the graph captured, the buffers sized
        step()
    b.sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    b.sync()
    per_step = (time.perf_counter() - t0) / steps * 1e3
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    lines = [
        f"host time of {steps} served decode steps of 1 session at depth {depth} by function "
        f"(cProfile, which slows the host: {per_step:.2f} ms a step under it; own time excludes "
        "callees, the wait for the GPU shows in the synchronising calls)",
        "",
        "| function | calls a step | own ms a step | with callees ms a step |",
        "| --- | --- | --- | --- |",
    ]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        lines.append(
            f"| `{_where(file, line, name)}` | {calls / steps:.1f} | {own * 1e3 / steps:.3f} | "
            f"{cum * 1e3 / steps:.3f} |"
        )
    return lines
