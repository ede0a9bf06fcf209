"""Where the GPU waits for the host: the idle gaps between one piece of work's GPU operations
(``bench model --gaps``), each put down to the op family method (``--gaps-by family``, the
default) or the Python frame (``--gaps-by frame``) that launched the operation after it.

Python call stacks make the profiler trace every Python call, which slows the host (a 4096-token
qwen4exp prompt chunk on an H100: 1,314 ms under them, 770 ms with ranges, 783 ms
unprofiled), so every gap grows and the table says where the host is slow under tracing. By
family, the work runs without stacks and each public method of the backend's op families
(``annotated``) opens a ``record_function`` range named ``family.method``: a few hundred ranges
a step instead of every Python call; the innermost range around a launch names its family. A
launch-bound step (an eager decode step) is slow under the profiler either way (its cost per
launch): its gaps say where the launches are, not how long the unprofiled host takes.

By family, the table of GPU operations by what launched them also gives each method's achieved
GB/s and TFLOP/s and its floor (the bytes and flops its calls must move and compute, costs.py,
summed per method as the work runs, figures.py).

The work runs once under torch.profiler; the chrome trace it writes has
every kernel, copy and memset on the GPU's timeline, the runtime or driver call that queued each
(linked by a correlation id), and the Python calls on the host's. A gap is a stretch of at least
``MIN_GAP_US`` in which no GPU operation runs. The operation that ends it was queued by a call on
some host thread; the innermost mgserve frame around that call is where the host was when the GPU
ran dry, and the host's synchronising calls overlapping the gap (a stream or event
synchronisation, a copy from or to pageable memory, a pinned allocation) say whether it was
waiting for the GPU itself. A ``cudaMemcpyAsync`` of pinned memory returns at once (the step
inputs' ``to_device``), so a copy call counts as a wait only when it is a synchronous one or the
copy it queued (its correlation id) names pageable memory. The table sums the gaps by frame: the
places to look at first.
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mgserve.bench.model.costs import Cost
from mgserve.bench.model.figures import Rates, Tally, ops_table
from mgserve.bench.model.trace import GPU_CATS, trace_events

MIN_GAP_US = 20.0
LONG_GAP_US = 1000.0  # gaps whose host calls the frame table breaks down
WAITS = ("Synchronize", "HostAlloc", "MallocHost", "cudaMalloc")
COPIES = ("cudaMemcpy", "cuMemcpy")  # waits unless Async from pinned memory (module docstring)


def gaps_table(sync: Callable[[], None], work: Callable[[], Any], what: str,
               backend: Any = None, rates: Rates | None = None) -> list[str]:  # fmt: skip
    """Runs ``work`` once under torch.profiler and returns table lines: the GPU's idle time and
    its gaps summed by what launched the operation ending each (``sync`` waits for the GPU): the
    op family method of ``backend`` if given, else the Python frame. By family, the operations
    table gives each method's achieved GB/s and TFLOP/s and its floor (costs.py; ``rates``)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    labels: set[str] = set()
    tally = Tally()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    ranges = annotated(backend, labels, tally)
    with ranges, profile(activities=acts, with_stack=backend is None) as p:
        t0 = time.perf_counter()
        work()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    costs = tally.figures() if labels else None
    return summarize(trace_events(p), what, wall, labels or None, costs, rates)


@contextmanager
def annotated(backend: Any, labels: set[str], tally: Tally | None = None) -> Iterator[None]:
    """Every public method of ``backend``'s op families (its dataclass fields but the weights,
    the kernels and the row path) runs inside ``record_function("family.method")`` until exit;
    the names go into ``labels``, each call's cost into ``tally`` (figures.py) if given. None:
    nothing is wrapped."""
    from torch.profiler import record_function

    tally = Tally() if tally is None else tally
    patched: list[tuple[Any, str]] = []
    fields = [] if backend is None else [f.name for f in dataclasses.fields(backend)]
    for fam_name in (f for f in fields if f not in ("dense", "kernels", "path")):
        fam = getattr(backend, fam_name)
        own = getattr(fam, "__dict__", None)
        if own is None:  # __slots__: nothing can be set on it
            continue
        for name, _ in inspect.getmembers(type(fam), inspect.isfunction):
            if name.startswith("_") or name in own:
                continue
            label = f"{fam_name}.{name}"
            setattr(fam, name, _ranged(getattr(fam, name), label, record_function, tally))
            patched.append((fam, name))
            labels.add(label)
    try:
        yield
    finally:
        for fam, name in patched:
            delattr(fam, name)


def _ranged(f: Callable[..., Any], label: str, record_function: Any, tally: Tally) -> Any:
    """``f`` run inside a profiler range named ``label``, its cost (from the arguments' host-side
    metadata: costs.py) summed into ``tally``."""

    def ranged(*a: Any, **k: Any) -> Any:
        frame = tally.enter(label, a, k)
        try:
            with record_function(label):
                return f(*a, **k)
        finally:
            tally.leave(frame)

    return ranged


def summarize(events: list[dict[str, Any]], what: str, wall_ms: float,
              labels: set[str] | None = None, costs: dict[str, Cost] | None = None,
              rates: Rates | None = None) -> list[str]:  # fmt: skip
    """The table of ``gaps_table`` from a chrome trace's events: gaps put down to the innermost
    range named in ``labels`` around each launch, or without labels to the innermost mgserve
    Python frame. ``costs`` (label -> summed bytes and flops: figures.Tally): the operations table
    gets GB/s, TFLOP/s and floor ms (``rates``) columns, blank where a label has none."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in spans if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return [f"GPU idle gaps of {what}: no GPU operations in the trace"]
    api = [e for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = {e["args"]["correlation"]: e for e in api if "correlation" in e.get("args", {})}
    pageable = {
        e.get("args", {}).get("correlation")
        for e in gpu
        if e.get("cat") == "gpu_memcpy" and "Pageable" in e["name"]
    }
    calls: dict[Any, list[dict[str, Any]]] = {}  # tid -> every Python call by start (frames)
    frames: dict[Any, list[dict[str, Any]]] = {}  # tid -> mgserve python frames by start
    waits: dict[Any, list[dict[str, Any]]] = {}  # tid -> synchronising calls by start
    for e in spans:
        ours = (
            e["name"] in labels
            if labels
            else (e.get("cat") == "python_function" and "mgserve" in e["name"])
        )
        if ours:
            frames.setdefault(e["tid"], []).append(e)
        if not labels and e.get("cat") == "python_function":
            calls.setdefault(e["tid"], []).append(e)
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and _waits(e, pageable):
            waits.setdefault(e["tid"], []).append(e)
    for d in (frames, waits, calls):
        for v in d.values():
            v.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in v] for tid, v in frames.items()}
    busy_end, idle = gpu[0]["ts"] + gpu[0]["dur"], 0.0
    by_frame: dict[str, list[float]] = {}  # cause -> [gap us, gaps]
    ops: dict[str, list[float]] = {}  # launcher -> [operations, GPU us, torch's own kernels]
    wheres = [_where(op, launches, frames, starts, bool(labels)) for op in gpu]
    for op, where in zip(gpu, wheres, strict=True):
        tot = ops.setdefault(where, [0, 0.0, 0])
        tot[0] += 1
        tot[1] += op["dur"]
        tot[2] += "at::native" in op["name"] or "at_cuda_detail" in op["name"]
    n_gaps = 0
    host: dict[str, float] = {}  # innermost Python call -> us of the long gaps it ran through
    for op, where in zip(gpu[1:], wheres[1:], strict=True):
        gap = op["ts"] - busy_end
        if gap >= MIN_GAP_US:
            n_gaps += 1
            idle += gap
            call = launches.get(op.get("args", {}).get("correlation"))
            if gap >= LONG_GAP_US and call is not None and not labels:  # frames: Python calls
                _innermost(calls.get(call["tid"], []), busy_end, op["ts"], host)
            key = _cause(op, where, launches, waits, busy_end)
            tot = by_frame.setdefault(key, [0.0, 0])
            tot[0] += gap
            tot[1] += 1
        busy_end = max(busy_end, op["ts"] + op["dur"])
    span = (busy_end - gpu[0]["ts"]) / 1e3
    lines = [
        f"GPU idle gaps of {what} (>= {MIN_GAP_US:.0f} us): {idle / 1e3:.2f} ms in {n_gaps} "
        f"gaps of {span:.2f} ms from its first GPU operation to its last ({wall_ms:.2f} ms wall, "
        f"profiled {'with op-family ranges' if labels else 'with Python stacks'})",
        "",
        f"| launched from ({'innermost op family method' if labels else 'innermost mgserve frame'}"
        "; a host wait in the gap) | gaps | ms |",
        "| --- | --- | --- |",
    ]
    for key, (us, n) in sorted(by_frame.items(), key=lambda kv: -kv[1][0])[:20]:
        lines.append(f"| `{key}` | {n} | {us / 1e3:.3f} |")
    if host:
        lines += [
            "",
            f"Host calls through the gaps of {LONG_GAP_US / 1e3:.0f} ms or more (innermost Python "
            "call on the thread that ended each gap)",
            "",
            "| innermost call | ms |",
            "| --- | --- |",
        ]
        for key, us in sorted(host.items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"| `{key}` | {us / 1e3:.3f} |")
    return lines + ops_table(what, len(gpu), ops, costs, rates)


def _innermost(calls: list[dict[str, Any]], t0: float, t1: float, out: dict[str, float]) -> None:
    """Adds to ``out`` the time of [t0, t1) spent in each call of ``calls`` (one thread's Python
    calls sorted by start) outside the calls it made: its self time in the gap. Every call that
    starts before t1 is looked at (one that encloses the gap may have started long before)."""
    j = bisect.bisect_left(calls, t1, key=lambda e: e["ts"])
    live = sorted(
        (e for e in calls[:j] if e["ts"] + e["dur"] > t0), key=lambda e: (e["ts"], -e["dur"])
    )

    def overlap(e: dict[str, Any]) -> float:
        return max(0.0, min(e["ts"] + e["dur"], t1) - max(e["ts"], t0))

    inner = [0.0] * len(live)  # each call's time in the gap inside the calls it made
    stack: list[int] = []  # calls still open at the current start, outermost first
    top = 0.0
    for i, e in enumerate(live):  # calls on one thread nest: a parent encloses its children
        while stack and live[stack[-1]]["ts"] + live[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            inner[stack[-1]] += overlap(e)
        else:
            top += overlap(e)
        stack.append(i)
    for e, nested in zip(live, inner, strict=True):
        if (own := overlap(e) - nested) > 0:
            out[_call(str(e["name"]))] = out.get(_call(str(e["name"])), 0.0) + own
    if (none := (t1 - t0) - top) > 0:
        out["(no Python call)"] = out.get("(no Python call)", 0.0) + none


def _call(name: str) -> str:
    """A Python call's name for the host table: mgserve's as ``_short``, others without their
    object addresses."""
    if "mgserve/" in name:
        return _short(name)
    return name.split(" at 0x")[0].split(" object")[0][:80]


def _waits(call: dict[str, Any], pageable: set[Any]) -> bool:
    """Whether a runtime or driver call holds the host until the GPU gets to it."""
    name = call["name"]
    if any(c in name for c in COPIES):
        return "Async" not in name or call.get("args", {}).get("correlation") in pageable
    return any(w in name for w in WAITS)


def _cause(op: dict[str, Any], where: str, launches: dict[Any, dict[str, Any]],
           waits: dict[Any, list[dict[str, Any]]], gap_start: float) -> str:  # fmt: skip
    """``where`` (``_where``: what queued ``op``) and the longest host wait on the queueing
    thread overlapping the gap before ``op``."""
    call = launches.get(op.get("args", {}).get("correlation"))
    if call is None:
        return where
    longest = None
    ws = waits.get(call["tid"], [])
    j = bisect.bisect_right(ws, op["ts"], key=lambda w: w["ts"])
    for w in ws[max(0, j - 64) : j]:  # waits that start before op (they do not nest)
        overlap = min(w["ts"] + w["dur"], op["ts"]) - max(w["ts"], gap_start)
        if overlap > 0 and (longest is None or overlap > longest[0]):
            longest = (overlap, w["name"])
    return where if longest is None else f"{where}; {longest[1]}"


def _where(op: dict[str, Any], launches: dict[Any, dict[str, Any]],
           frames: dict[Any, list[dict[str, Any]]], starts: dict[Any, list[float]],
           ranges: bool) -> str:  # fmt: skip
    """The innermost mgserve frame (or op family range) around the call that queued ``op``."""
    call = launches.get(op.get("args", {}).get("correlation"))
    if call is None:
        return "(no launch found)"
    tid, ts = call["tid"], call["ts"]
    fr, st = frames.get(tid, []), starts.get(tid, [])
    i = bisect.bisect_right(st, ts)
    for e in reversed(fr[max(0, i - 4000) : i]):  # the latest-starting frame that encloses it
        if e["ts"] + e["dur"] >= ts:
            return str(e["name"]) if ranges else _short(e["name"])
    return "(outside the op families)" if ranges else "(no mgserve frame)"


def _short(name: str) -> str:
    """``.../mgserve/cuda/ops/moe_prefill.py(123): moe_prefill`` -> ``cuda/ops/moe_prefill.py:
    moe_prefill`` (frames are summed by function, not line)."""
    path, _, func = name.partition(": ")
    path = path.split("mgserve/", 1)[-1].split("(")[0]
    return f"{path}: {func}"
