"""The achieved rates of ``bench model --gaps``'s op family methods: ``Tally`` sums each call's
cost (costs.py: bytes and flops at least, from host-side metadata) per ``family.method`` while the
work runs inside gaps.py's ranges, and ``ops_table`` prints the GPU operations by what launched
them with each method's GB/s (bytes / the GPU time of its operations), TFLOP/s and floor ms: the
larger of bytes / the measured device-to-device copy rate and flops / a tensor peak (``Rates``).

A cost function that raises or returns None costs its call its figure, never the run: the label
then gets no figures (blank cells), as do methods without a cost function.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from mgserve.bench.model.costs import COSTS, Cost

# nominal dense f16/bf16 tensor-core peaks (datasheet, TFLOP/s) by the name torch reports
NOMINAL_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 SXM": 989.0, "NVIDIA H200": 989.0}


class Rates(NamedTuple):
    """The floor's rates: the device-to-device copy rate (GB/s counting bytes read plus bytes
    written, as bench/matvec.py's ``_copy_rate`` measures it: a cost's bytes count reads and
    writes too, so the floor is bytes / copy_gbps) and the tensor peak (TFLOP/s; None: no floor
    from flops)."""

    copy_gbps: float | None
    peak_tflops: float | None = None


def nominal_peak(gpu_name: str) -> float | None:
    """The nominal (datasheet) dense f16 tensor peak of a GPU by its name, or None if unknown."""
    return NOMINAL_TFLOPS.get(gpu_name.strip())


class Tally:
    """Per label, the summed costs of the calls made while the work ran. A call's cost goes to
    the innermost costed call, as its GPU operations go to the innermost range: a call that
    makes costed calls of other family methods (``linear.matmul``'s decode rows through
    ``linear.matvec``, a prompt ``hc.mix`` through ``linear.matmul``) hands its cost to them."""

    def __init__(self, costs: dict[str, Callable[..., Cost | None]] | None = None) -> None:
        self.costs = COSTS if costs is None else costs
        self.rows: dict[str, list[float]] = {}  # label -> [bytes, flops, costed, missing]
        self._local = threading.local()  # per thread: the stack of open calls

    def enter(self, label: str, a: tuple[Any, ...], k: dict[str, Any]) -> list[Any]:
        """Opens a call of ``label`` with arguments ``a``, ``k``: its frame for ``leave``."""
        fn, cost = self.costs.get(label), None
        if fn is not None:
            try:
                cost = fn(*a, **k)
            except Exception:  # a cost function's failure is no figure, never a failed run
                cost = None
        stack = self._local.__dict__.setdefault("stack", [])
        frame = [label, fn is not None, cost, False]  # label, has a cost function, cost, handed
        stack.append(frame)
        return frame

    def leave(self, frame: list[Any]) -> None:
        """Closes ``frame``'s call: its cost to its label unless calls inside took it."""
        stack = self._local.stack
        stack.pop()
        label, has_fn, cost, handed = frame
        if not handed and has_fn:
            row = self.rows.setdefault(label, [0.0, 0.0, 0, 0])
            if cost is None:
                row[3] += 1
            else:
                row[0] += cost.bytes
                row[1] += cost.flops
                row[2] += 1
        if stack and (handed or (has_fn and cost is not None)):
            stack[-1][3] = True

    def figures(self) -> dict[str, Cost]:
        """The summed costs of the labels all of whose own calls had one."""
        return {lab: Cost(r[0], r[1]) for lab, r in self.rows.items() if r[2] and not r[3]}


def cells(cost: Cost | None, us: float, rates: Rates | None) -> str:
    """The GB/s, TFLOP/s and floor ms cells of a row of ``us`` GPU microseconds (blank where
    there is no figure)."""
    if cost is None or us <= 0:
        return " | | |"
    gbs = f"{cost.bytes / us / 1e3:.0f}"
    tflops = f"{cost.flops / us / 1e6:.1f}" if cost.flops else ""
    floors = []
    if rates is not None and rates.copy_gbps:
        floors.append(cost.bytes / (rates.copy_gbps * 1e9))
    if rates is not None and rates.peak_tflops and cost.flops:
        floors.append(cost.flops / (rates.peak_tflops * 1e12))
    floor = f"{max(floors) * 1e3:.3f}" if floors else ""
    return "".join(f" {c} |" if c else " |" for c in (gbs, tflops, floor))


def rates_note(rates: Rates | None) -> str:
    """What the floor column means for these rates."""
    parts = []
    if rates is not None and rates.copy_gbps:
        parts.append(f"bytes at the copy rate {rates.copy_gbps:.0f} GB/s (read+write)")
    if rates is not None and rates.peak_tflops:
        parts.append(f"flops at {rates.peak_tflops:.0f} TFLOP/s (nominal, datasheet dense f16)")
    if not parts:
        return "no floor ms: no rates given"
    return "floor ms: " + (" or ".join(parts) + ", the larger" if len(parts) > 1 else parts[0])


def ops_table(what: str, n_ops: int, ops: dict[str, list[float]], costs: dict[str, Cost] | None,
              rates: Rates | None) -> list[str]:  # fmt: skip
    """The operations table: per launcher (``ops``: label -> [operations, GPU us, torch's own
    kernels]) by operation count; with ``costs`` (even empty) the rate and floor columns."""
    lines = ["", f"GPU operations of {what} by what launched them ({n_ops} in all)"]
    head = "| launched from | operations | of them torch's kernels | GPU ms |"
    if costs is not None:
        lines.append(f"(bytes and flops at least per call: costs.py; {rates_note(rates)})")
        head += " GB/s | TFLOP/s | floor ms |"
    lines += ["", head, "|" + " --- |" * (head.count("|") - 1)]
    for key, (n, us, native) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:20]:
        row = f"| `{key}` | {n:.0f} | {native:.0f} | {us / 1e3:.3f} |"
        lines.append(row if costs is None else row + cells(costs.get(key), us, rates))
    return lines
