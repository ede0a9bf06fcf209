"""Benchmarks behind ``mgserve bench NAME``. Each module has ``add_arguments(parser)`` and
``run(args) -> int``; results are printed as a table and, with ``--record``, appended to
BENCHMARKS.md with date, machine and command, so every speed claim has a reproducible source."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# command names; the module of ``a-b`` is ``mgserve.bench.a_b``
BENCHMARKS = (
    "tokenize",
    "decode",
    "synth",
    "matvec",
    "model",
    "plot",
    "glue",
    "ple-host",
    "sampling-host",
    "engine-host",
    "invariance",
    "grammar",
    "structured",
    "mixed",
    "turn",
    "spec",
    "spec-sim",
    "verify",
    "pipeline-model",
    "pipeline-dist",
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = gpu_name()
    host = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {cpu}"
    return f"{host}; GPU: {gpu}" if gpu else host


def gpu_name() -> str:
    """The first GPU's name where the bench has loaded torch and it sees one, else "" (a CPU
    bench does not import torch for this)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:  # a broken driver: the line names the host only
        pass
    return ""


def record(title: str, body: str, path: str | Path = "BENCHMARKS.md") -> None:
    """Append one run to BENCHMARKS.md: date, machine, the exact command, then ``body``."""
    cmd = "mgserve " + " ".join(sys.argv[1:]) if sys.argv else "mgserve bench"
    entry = (
        f"\n## {title}\n\n"
        f"- date: {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}\n"
        f"- machine: {machine()}\n"
        f"- command: `{cmd}`\n\n{body.rstrip()}\n"
    )
    p = Path(path)
    if not p.exists():
        p.write_text("# Benchmarks\n\nEvery row comes from `mgserve bench ...`; newest last.\n")
    with p.open("a") as f:
        f.write(entry)


def median_us(fn: Callable[[], object], repeat: int) -> float:
    """Median over 5 runs of ``repeat`` calls of ``fn``, in microseconds per call (the CPU
    benches' timing: ple-host, sampling-host)."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - t0) / repeat * 1e6)
    return statistics.median(runs)
