"""Counters, gauges and histograms, rendered as Prometheus text exposition (format 0.0.4).

Small and hand-written: everything lives on the event loop, so nothing here locks. Gauges are read
through a callback at render time, so they are never stale.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import TypeVar

# seconds; from 1 ms (a fast GPU decode step) to a minute (a long CPU prompt)
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help, label
        self.values: dict[str, float] = {} if label else {"": 0.0}

    def inc(self, n: float = 1.0, label: str = "") -> None:
        self.values[label] = self.values.get(label, 0.0) + n

    def value(self, label: str = "") -> float:
        return self.values.get(label, 0.0)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for label, v in sorted(self.values.items()):
            sel = f'{{{self.label}="{label}"}}' if self.label else ""
            out.append(f"{self.name}{sel} {_num(v)}")
        return out


class Gauge:
    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f"{self.name} {_num(self.read())}",
        ]


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for le, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cum += n
            out.append(f'{self.name}_bucket{{le="{_num(le)}"}} {cum}')
        out.append(f"{self.name}_sum {_num(self.sum)}")
        out.append(f"{self.name}_count {self.count}")
        return out


M = TypeVar("M", Counter, Gauge, Histogram)


class Registry:
    def __init__(self) -> None:
        self._metrics: list[Counter | Gauge | Histogram] = []

    def add(self, metric: M) -> M:
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"
