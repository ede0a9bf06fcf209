"""What one decode step costs the GPU: the weight bytes it reads (for the achieved bandwidth) and
the per-kernel time of one eager step (torch.profiler); where the GPU waits for the host in a step
(gaps.py)."""

from __future__ import annotations

from typing import Any

from mgserve.bench.model.figures import Rates
from mgserve.bench.model.gaps import gaps_table
from mgserve.bench.model.harness import ModelBench
from mgserve.bench.model.workloads import decoding


def bytes_per_token(model: Any) -> float:
    """Weight bytes one decode token reads: everything but the routed experts, plus the chosen
    share of those (n_expert_used / n_expert), plus the output head."""
    from mgserve.cuda.ops.moe import ExpertWeights
    from mgserve.cuda.weights import QuantWeight

    seen: set[int] = set()
    total = 0.0

    def walk(obj: Any, share: float) -> None:
        nonlocal total
        if isinstance(obj, QuantWeight):
            if obj.data.data_ptr() not in seen:
                seen.add(obj.data.data_ptr())
                total += obj.nbytes * share
        elif isinstance(obj, ExpertWeights):
            hp = model.hp
            for w in (obj.gate, obj.up, obj.gate_up, obj.down):
                if w is not None:
                    walk(w, hp.n_expert_used / hp.n_expert)
        elif isinstance(obj, (list, tuple, dict)):
            for o in obj.values() if isinstance(obj, dict) else obj:
                walk(o, share)
        elif hasattr(obj, "__dataclass_fields__"):
            for f in obj.__dataclass_fields__:
                walk(getattr(obj, f), share)

    walk(model.layers, 1.0)
    walk(model.output, 1.0)
    return total


def _decode_work(b: ModelBench, depth: int, sessions: int) -> tuple[Any, str]:
    """One eager decode step of ``sessions`` sessions at ``depth``, run once to warm up: (the
    step, what it is)."""
    from mgserve.cuda.graphs import DecodeInputs, EagerDecode

    for s in range(sessions):
        b.fill(s, depth)
    eager = EagerDecode(b.model, b.device)
    tokens = [(1000 + s) % b.vocab for s in range(sessions)]  # tiny test vocabularies too
    inp = DecodeInputs(tokens, [max(depth, 1)] * sessions, list(range(sessions)), None)
    if getattr(b.model, "decode_extra_shape", None) is not None:
        inp.extra = b.model.step_extra([[t] for t in tokens], list(range(sessions)))
    eager(inp)
    b.sync()
    what = f"one eager decode step at depth {depth}"
    if sessions > 1:
        what = f"one eager decode step of {sessions} sessions at depth {depth}"
    return (lambda: eager(inp)), what


def _prefill_work(b: ModelBench, n: int, depth: int) -> tuple[Any, str]:
    """A prefill step of ``n`` tokens at ``depth``, its shapes warmed up: (the step, what)."""
    b.fill(0, depth)
    b.prefill(0, depth, n)  # warm: the same shapes compiled and cached
    b.fill(0, depth)
    return (lambda: b.prefill(0, depth, n)), f"a {n}-token prefill at depth {depth}"


def profile_decode(b: ModelBench, depth: int, sessions: int = 1) -> list[str]:
    """Per-kernel GPU time of one eager decode step of ``sessions`` sessions at ``depth``
    (torch.profiler): table lines."""
    return _kernel_table(b, *_decode_work(b, depth, sessions))


def profile_prefill(b: ModelBench, n: int, depth: int) -> list[str]:
    """Per-kernel GPU time of one prefill step of ``n`` tokens at ``depth``: table lines."""
    return _kernel_table(b, *_prefill_work(b, n, depth))


def gaps_decode(b: ModelBench, depth: int, rates: Rates | None = None) -> list[str]:
    """Where the GPU waits for the host in one eager decode step at ``depth`` (gaps.py); by
    family, each method's rates against the floor of ``rates`` (figures.py)."""
    return gaps_table(b.sync, *_decode_work(b, depth, 1), backend=_families(b), rates=rates)


def gaps_prefill(b: ModelBench, n: int, depth: int, rates: Rates | None = None) -> list[str]:
    """Where the GPU waits for the host in one prefill step of ``n`` tokens (``gaps_decode``)."""
    return gaps_table(b.sync, *_prefill_work(b, n, depth), backend=_families(b), rates=rates)


def gaps_served(b: ModelBench, depth: int, steps: int = 8) -> list[str]:
    """Where the GPU waits for the host between decode steps as the runner serves them (CUDA
    graphs unless ``--no-graphs``; one session at ``depth``): the idle time over ``steps`` steps
    is the host's share of a step (sampling, the next step's inputs, the PLE rows), which the
    eager step's table cannot show (its launches swamp it)."""
    step = decoding(b, 1, depth)

    def run(n: int) -> None:
        for _ in range(n):
            step()

    run(3)  # the graph captured, the buffers sized
    graphs = not b.args.no_graphs and b.device.type == "cuda"  # (the CPU runner is eager)
    how = "CUDA graphs" if graphs else "eager"
    what = f"{steps} decode steps of 1 session at depth {depth} as served ({how})"
    return gaps_table(b.sync, lambda: run(steps), what, backend=_families(b))


def _families(b: ModelBench) -> Any:
    """The backend whose op families ``--gaps-by family`` annotates (None: Python frames)."""
    return b.ops if b.args.gaps_by == "family" else None


def _kernel_table(b: ModelBench, work: Any, what: str) -> list[str]:
    """Runs ``work`` once under torch.profiler: the kernels' summed GPU time against the wall
    time (their difference is host time the GPU waited for), the top kernels by time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    b.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        work()
        b.sync()
        wall = (time.perf_counter() - t0) * 1e3
    rows: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            rows.setdefault(ev.name[:60], []).append(ev.device_time_total / 1e3)
    total = sum(sum(v) for v in rows.values())
    launches = sum(len(v) for v in rows.values())
    lines = [
        f"per-kernel GPU time of {what}: {total:.2f} ms in {launches} launches "
        f"({wall:.2f} ms wall, profiled)",
        "",
        "| kernel | launches | ms | share |",
        "| --- | --- | --- | --- |",
    ]
    for name, ts in sorted(rows.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"| `{name}` | {len(ts)} | {sum(ts):.3f} | {100 * sum(ts) / total:.1f}% |")
    return lines
