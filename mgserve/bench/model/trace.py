"""A torch.profiler run's chrome trace as events, and its GPU operations (gaps.py, served.py)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of GPU operations


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a finished ``torch.profiler.profile``'s chrome trace."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return events


def gpu_ops(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(name, start, end) in microseconds of a chrome trace's GPU operations."""
    return [
        (e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in GPU_CATS
    ]
