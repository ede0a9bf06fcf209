"""The seed's machine and figures for ``mgserve bench pipeline-model``: a machine (a GPU model,
PCIe lanes per GPU, the decode loop), the predictions of the pipeline model for it, and the
table beside the figures the seed measured (shared/SEED.md, 6x3090, the fork)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mgserve.config import Settings
from mgserve.devices import parse_split
from mgserve.pipeline.costs import ModelCosts
from mgserve.pipeline.gpumodel import PCIE_LANE_GBPS, GpuModel, PcieModel
from mgserve.pipeline.perfmodel import Prediction, predict
from mgserve.pipeline.report import render
from mgserve.pipeline.stages import stage_plan
from mgserve.sizes import parse_size

# the fork's measured tokens/s on 6x3090: prefill of 250k, decode at 250k for 1 and 5 sessions
SEED = {"prefill": 2111.0, "decode 1": 33.7, "decode 5": 27.3}
REBALANCE_ROUNDS = 3  # --balance prefill|decode: plan, time the stages, re-plan by those times


@dataclass(frozen=True)
class Machine:
    gpu: GpuModel
    pcie: PcieModel
    lanes: tuple[int, ...]  # PCIe lanes of each GPU, in pipeline order
    loop_s: float  # decode: the sampled token to the host and the next step's start

    def describe(self, args: argparse.Namespace, gens: Sequence[int]) -> str:
        g, p = self.gpu, self.pcie
        raw = "/".join(f"{PCIE_LANE_GBPS[x]:g}" for x in gens)
        hops = "peer copies" if p.p2p else "two copies staged through pinned host memory"
        return "\n".join([
            "assumptions (each an option of this command):",
            f"  GPU: {g.name}, {g.bandwidth_gbps:g} GB/s x {g.bandwidth_eff:g} for a step's "
            f"reads, {g.tflops:g} TFLOPS x {g.flops_eff:g} for its matrix products (the longer "
            f"of the two per layer), {g.layer_overhead_us:g} us per layer and step",
            f"  PCIe {'/'.join(f'{x}.0' for x in gens)}: lanes {','.join(map(str, self.lanes))}"
            f", {raw} GB/s raw per lane x {p.lane_eff:g}, {p.latency_us:g} us per copy; hops: "
            f"{hops}; the host feeds GPU 0 on its lanes; decode loop {self.loop_s * 1e6:g} us",
            f"  memory: {args.gpu_memory} per GPU for {args.slots} slots x {args.ctx:,} tokens, "
            f"K/V {args.cache_type}; prompts in chunks of {args.chunk} tokens",
            "  experts routed uniformly (a step of t tokens reads 1-(1-k/n)^t of them); decode "
            "micro-batches: the best grouping of the sessions (each its own, or fewer larger)",
        ])  # fmt: skip


def load_costs(args: argparse.Namespace) -> tuple[ModelCosts, str]:
    """The per-layer costs of ``--model`` or of the synthetic ``--shape``, and a label."""
    if args.model:
        from mgserve.core.gguf.reader import GGUFFile

        g = GGUFFile(args.model)
        label = str(args.model)
    else:
        from mgserve.cuda.synth_device import SynthFile

        g = SynthFile.from_shape(args.shape, layers=args.layers, experts=args.experts, mix=args.mix)
        label = f"{g.path}"
    return ModelCosts.of(g, args.cache_type, args.cache_type), label


def predict_machine(costs: ModelCosts, settings: Settings, m: Machine, args: argparse.Namespace,
                    sessions: Sequence[int]) -> tuple[str, dict[str, float]]:  # fmt: skip
    """(the stage plan and stage times as text, the predicted tokens/s by workload)."""
    n, gpu = len(m.lanes), m.gpu
    room = parse_size(args.gpu_memory, "gpu-memory")
    split = parse_split(args.tensor_split) if args.tensor_split else None
    free = [(room, f"--gpu-memory {args.gpu_memory}")] * n
    sp = stage_plan(costs, settings, range(n), free, split)
    parts = [st.part for st in sp.stages]

    def chunk_times(tokens: int, depth: int) -> list[float]:
        return [gpu.prefill_chunk(costs, p, tokens, depth) for p in parts]

    def step_times(b: int, depth: int) -> list[float]:
        return [gpu.decode_step(costs, p, b, depth) for p in parts]

    for _ in range(REBALANCE_ROUNDS if split is None and args.balance != "bytes" else 0):
        times = (
            chunk_times(args.chunk, args.prompt // 2)
            if args.balance == "prefill"
            else step_times(1, args.depth)
        )  # what a run would measure per stage; the plan is then balanced by it
        sp = stage_plan(
            costs, settings, range(n), free, None, sp.balance.from_times(sp.ranges, times)
        )
        parts = [st.part for st in sp.stages]

    links = m.pcie.hops(m.lanes)
    pred = predict(
        chunk_times, step_times, links, costs.handoff_bytes, prompt=args.prompt,
        chunk=args.chunk, depth=args.depth, sessions=sessions,
        host=m.pcie.host_link(m.lanes[0]), host_bytes=costs.host_bytes, loop_s=m.loop_s,
    )  # fmt: skip
    res = {"prefill": pred.prefill.tokens_per_s}
    for d in pred.decode:
        res[f"decode {d.sessions}"] = d.per_session_tps
    return _details(sp, chunk_times, step_times, links, costs, args, pred), res


def _details(sp: object, chunk_times: Callable[[int, int], list[float]],
             step_times: Callable[[int, int], list[float]], links: Sequence[object],
             costs: ModelCosts, args: argparse.Namespace, pred: Prediction) -> str:  # fmt: skip
    mid = args.prompt // 2
    pre, dec = chunk_times(args.chunk, mid), step_times(1, args.depth)
    lines = [render(sp)]  # type: ignore[arg-type]
    lines.append(
        f"  per stage: a {args.chunk}-token chunk at depth {mid:,} (ms): "
        + ", ".join(f"{t * 1e3:.1f}" for t in pre)
        + f"; a 1-session decode step at {args.depth:,} (ms): "
        + ", ".join(f"{t * 1e3:.2f}" for t in dec)
    )
    xfer = [lk.time(args.chunk * costs.handoff_bytes) * 1e3 for lk in links]  # type: ignore[attr-defined]
    lines.append(
        f"  per link: a chunk's hand-off ({args.chunk * costs.handoff_bytes / 1e6:.1f} MB, ms): "
        + ", ".join(f"{t:.1f}" for t in xfer)
        + f"; prefill bottleneck: {pred.prefill.bottleneck}"
    )
    return "\n".join(lines)


def table(results: dict[str, dict[str, float]], sessions: Sequence[int], prompt: int,
          depth: int) -> list[str]:  # fmt: skip
    """Predictions per link generation beside the seed's figures (prefill of 250k, decode at
    250k: shown where ``prompt`` and ``depth`` are those), as a markdown table."""
    cols, seed = list(results), prompt == depth == 250_000
    rows = [("prefill", f"prefill, 1 session, {prompt:,}-token prompt (t/s)")]
    for n in sessions:
        who = "1 session" if n == 1 else f"{n} sessions, per session"
        rows.append((f"decode {n}", f"decode at {depth:,}, {who} (t/s)"))
    out = [
        "| workload | " + " | ".join(cols) + " | seed (fork, measured) |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for key, name in rows:
        cells = " | ".join(f"{results[c][key]:.1f}" for c in cols)
        out.append(f"| {name} | {cells} | {SEED[key] if seed and key in SEED else '-'} |")
    return out


def bisect(f: Callable[[float], float], lo: float, hi: float, steps: int = 40) -> float:
    """A root of ``f`` (monotone) in [lo, hi]; the nearer end when it has none there."""
    flo, fhi = f(lo), f(hi)
    if flo * fhi > 0:
        return lo if abs(flo) < abs(fhi) else hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        fm = f(mid)
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
    return (lo + hi) / 2
