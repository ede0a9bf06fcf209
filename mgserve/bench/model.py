"""Whole-model prefill and decode throughput on the device backend (the issue-4 table).

The model is a GGUF file (``--model``, any tool's layout) or a synthetic model of a named shape
made directly in GPU memory (``--shape``; random valid blocks, no file). Every workload goes
through the ``DeviceRunner`` exactly as serving does (scheduler-shaped batches, graphs, device
sampling, one event per step):

- prefill: a prompt of P tokens in chunks of ``--ubatch``, at depth D (the session first holds D
  tokens); tokens/s over the timed prompt;
- decode: B sessions at depth D, ``--decode-steps`` timed steps after warm-up; aggregate tokens/s.

Depth is reached either by really prefilling (``--fill prefill``) or by writing random state into
the pools (``--fill synthetic``: random q8_0/f16 K/V, block keys and recurrent states for positions
< D), which costs seconds instead of minutes; attention's cost depends on the depth, not on the
values. ``--profile`` adds a per-kernel breakdown of one eager decode step (torch.profiler) and the
achieved bandwidth against the card's copy rate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

DEFAULT_DEPTHS = "0,32768,131072,250000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a GGUF file")
    src.add_argument("--shape", help="a synthetic model of this shape (see mgserve synth)")
    parser.add_argument("--layers", type=int, default=None, help="synthetic: layers")
    parser.add_argument("--experts", type=int, default=None, help="synthetic: routed experts")
    parser.add_argument("--ple-rows", type=int, default=None, help="synthetic: PLE table rows")
    parser.add_argument("--ctx", type=int, default=262144, help="context per slot")
    parser.add_argument("--slots", type=int, default=5, help="slots (sessions) in the pools")
    parser.add_argument("--cache-type", default="q8_0", help="K and V cache type")
    parser.add_argument("--ubatch", type=int, default=4096, help="prompt tokens per step")
    parser.add_argument("--prefill", default="4096@0,4096@32768", help="P@D prefill workloads")
    parser.add_argument("--long-prefill", type=int, default=0, help="one prompt of N tokens")
    parser.add_argument("--multi-prefill", default="", help="S@N: S sessions of N-token prompts")
    parser.add_argument(
        "--sampled-prefill",
        default="",
        help="S@N: S sessions of N-token prompts, estimated from one ubatch step per session at "
        "5 depths spread over the prompt (synthetic state below each); for prompts too long to run",
    )
    parser.add_argument("--decode", default=DEFAULT_DEPTHS, help="1-session decode depths")
    parser.add_argument("--multi-decode", default="5@32768,5@131072", help="B@D decode workloads")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic")
    parser.add_argument("--int8", action="store_true", help="int8-activation matvecs")
    parser.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="per-kernel decode breakdown")


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("@")
        out.append((int(a), int(b or 0)))
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from mgserve.cuda.backend import cuda_backend, load_device_model
        from mgserve.cuda.runner import DeviceRunner

        self.torch = torch
        self.device = torch.device("cuda", 0)
        if args.model:
            from mgserve.core.gguf.reader import GGUFFile

            g: Any = GGUFFile(args.model)
        else:
            from mgserve.cuda.synth_device import SynthFile

            g = SynthFile.from_shape(
                args.shape, layers=args.layers, experts=args.experts, ple_rows=args.ple_rows
            )
        self.source = str(g.path)
        t0 = time.perf_counter()
        self.ops = cuda_backend(0, int8=args.int8)
        self.model = load_device_model(
            g, self.ops, self.device, args.slots, args.ctx, args.cache_type, args.cache_type
        )
        if not args.model:
            from mgserve.cuda.synth_device import release_pools

            release_pools()
        torch.cuda.synchronize()
        self.load_s = time.perf_counter() - t0
        self.runner = DeviceRunner(self.model, self.device, graphs=not args.no_graphs)
        self.args = args
        self.step = 0
        self.vocab = self.model.spec.n_vocab
        self.warm_up()

    def warm_up(self) -> None:
        """Compile every kernel (or read it from the cubin cache) and size the workspaces once, so
        no timed workload pays for it: a short prefill, then a few decode steps."""
        ub = min(self.args.ubatch, self.args.ctx // 2)
        toks = self._tokens(ub + 43, 99)
        self._run([self._work(0, toks[:ub], 0, True)])  # a whole ubatch: GEMM shapes, scratch
        self._run([self._work(0, toks[ub:], ub, True)])
        for i in range(3):
            self._run([self._work(0, (500 + i,), ub + 43 + i, True)])
        self.torch.cuda.synchronize()

    # -- building batches --------------------------------------------------------------------

    def _tokens(self, n: int, seed: int) -> tuple[int, ...]:
        g = self.torch.Generator().manual_seed(seed)
        return tuple(self.torch.randint(100, self.vocab - 100, (n,), generator=g).tolist())

    def _run(self, work: list[Any]) -> Any:
        from mgserve.core.engine.contract import ScheduledBatch

        self.step += 1
        return self.runner.run(ScheduledBatch(self.step, tuple(work)))

    def _work(self, slot: int, tokens: tuple[int, ...], start: int, sample: bool) -> Any:
        from mgserve.core.engine.contract import SamplingParams, SeqWork

        return SeqWork(
            slot=slot, request_id=f"bench-{slot}", tokens=tokens, start=start, sample=sample,
            sampling=SamplingParams(temperature=0.0), new_sequence=start == 0,
        )  # fmt: skip

    def fill(self, slot: int, depth: int) -> None:
        """Bring ``slot`` to ``depth`` tokens (a new sequence)."""
        if depth == 0:
            self.model.begin_sequence(slot)
            return
        if self.args.fill == "prefill":
            self.prefill(slot, 0, depth)
            return
        from mgserve.cuda.fill import fill_synthetic

        self._run([self._work(slot, self._tokens(1, slot), 0, False)])  # new sequence, position 0
        fill_synthetic(self.model, slot, depth)

    def prefill(self, slot: int, start: int, n: int) -> None:
        ub = self.args.ubatch
        toks = self._tokens(n, 7 + slot)
        for c in range(0, n, ub):
            part = toks[c : c + ub]
            self._run([self._work(slot, part, start + c, c + ub >= n)])

    # -- workloads ---------------------------------------------------------------------------

    def time_prefill(self, n: int, depth: int) -> float:
        self.fill(0, depth)
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.prefill(0, depth, n)
        self.torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)

    def time_multi_prefill(self, sessions: int, n: int) -> float:
        """``sessions`` prompts of ``n`` tokens, one chunk of each per step (as the scheduler
        interleaves them)."""
        ub = self.args.ubatch
        prompts = [self._tokens(n, 11 + s) for s in range(sessions)]
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        for c in range(0, n, ub):
            self._run([self._work(s, p[c : c + ub], c, c + ub >= n) for s, p in enumerate(prompts)])
        self.torch.cuda.synchronize()
        return sessions * n / (time.perf_counter() - t0)

    def time_sampled_prefill(self, sessions: int, n: int, samples: int = 5) -> tuple[float, str]:
        """Aggregate tokens/s of ``sessions`` prompts of ``n`` tokens, estimated: at the midpoints
        of ``samples`` equal parts of the prompt, each session is filled to that depth and one step
        with an ubatch chunk of every session is timed; the estimate is the mean step time."""
        ub = self.args.ubatch
        depths = [int((i + 0.5) * n / samples) // ub * ub for i in range(samples)]
        times = []
        for d in depths:
            for s in range(sessions):
                self.fill(s, d)
            work = [self._work(s, self._tokens(ub, 31 + s), d, True) for s in range(sessions)]
            self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            self._run(work)
            self.torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        note = "sampled at depths " + "/".join(f"{d // 1024}k" for d in depths)
        return sessions * ub / statistics.mean(times), note

    def time_decode(self, sessions: int, depth: int) -> tuple[float, float]:
        """(aggregate tokens/s, median step ms) of ``sessions`` sessions decoding at ``depth``."""
        for s in range(sessions):
            self.fill(s, depth)
        pos = [max(depth, 1)] * sessions
        if depth == 0:  # a one-token prompt first, so decode starts at position 1
            self._run([self._work(s, self._tokens(1, s), 0, True) for s in range(sessions)])
        times = []
        for i in range(self.args.decode_steps + 3):
            t0 = time.perf_counter()
            self._run([self._work(s, (1000 + i,), pos[s], True) for s in range(sessions)])
            if i >= 3:  # warm-up steps capture the graph
                times.append(time.perf_counter() - t0)
            pos = [p + 1 for p in pos]
        step = statistics.median(times)
        return sessions / step, step * 1e3

    def profile_decode(self, depth: int) -> list[str]:
        """Per-kernel GPU time of one eager decode step at ``depth`` (torch.profiler)."""
        from torch.profiler import ProfilerActivity, profile

        from mgserve.cuda.graphs import DecodeInputs, EagerDecode

        self.fill(0, depth)
        eager = EagerDecode(self.model, self.device)
        inp = DecodeInputs([1000], [max(depth, 1)], [0], None)
        if getattr(self.model, "decode_extra_shape", None) is not None:
            inp.extra = self.model.step_extra([[1000]], [0])
        eager(inp)
        self.torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager(inp)
            self.torch.cuda.synchronize()
        rows: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                rows.setdefault(ev.name[:60], []).append(ev.device_time_total / 1e3)
        total = sum(sum(v) for v in rows.values())
        lines = [
            f"per-kernel GPU time of one eager decode step at depth {depth}: {total:.2f} ms",
            "",
            "| kernel | launches | ms | share |",
            "| --- | --- | --- | --- |",
        ]
        for name, ts in sorted(rows.items(), key=lambda kv: -sum(kv[1]))[:25]:
            lines.append(f"| `{name}` | {len(ts)} | {sum(ts):.3f} | {100 * sum(ts) / total:.1f}% |")
        return lines


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
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, share)
        elif hasattr(obj, "__dataclass_fields__"):
            for f in obj.__dataclass_fields__:
                walk(getattr(obj, f), share)

    walk(model.layers, 1.0)
    walk(model.output, 1.0)
    return total


def run(args: argparse.Namespace) -> int:
    import torch

    from mgserve.bench.matvec import _copy_rate
    from mgserve.cuda import runtime

    b = Bench(args)
    m = b.model
    gpu = runtime.gpu_info().name
    copy = _copy_rate(torch)
    per_tok = bytes_per_token(m)
    head = [
        f"GPU: {gpu}; device-to-device copy {copy:.0f} GB/s (read+write)",
        f"model: {b.source}, {m.spec.arch}, {m.spec.n_layer} layers, "
        f"{m.weight_bytes / 1e9:.1f} GB of weights on the GPU, loaded in {b.load_s:.1f} s; "
        f"{per_tok / 1e9:.2f} GB of weights read per decode token",
        f"slots {args.slots} x ctx {args.ctx}, cache {args.cache_type}, ubatch {args.ubatch}, "
        f"int8 {args.int8}, graphs {not args.no_graphs}, depth fill {args.fill}",
        "",
        "| workload | tokens/s | notes |",
        "| --- | --- | --- |",
    ]
    lines = list(head)

    def row(name: str, tps: float, note: str = "") -> None:
        lines.append(f"| {name} | {tps:.1f} | {note} |")
        print(lines[-1], flush=True)

    print("\n".join(head), flush=True)
    for n, depth in _pairs(args.prefill):
        row(f"prefill {n} tokens at depth {depth}", b.time_prefill(n, depth))
    if args.long_prefill:
        row(
            f"prefill of a {args.long_prefill}-token prompt (average)",
            b.time_prefill(args.long_prefill, 0),
        )
    for sessions, n in _pairs(args.multi_prefill):
        row(
            f"prefill, {sessions} sessions of {n} tokens, aggregate",
            b.time_multi_prefill(sessions, n),
        )
    for sessions, n in _pairs(args.sampled_prefill):
        tps, note = b.time_sampled_prefill(sessions, n)
        what = "a prompt" if sessions == 1 else f"{sessions} sessions' prompts"
        row(f"prefill of {what} of {n} tokens (estimate)", tps, note)
    for depth in [int(d) for d in args.decode.split(",") if d.strip()]:
        tps, ms = b.time_decode(1, depth)
        row(
            f"decode, 1 session at depth {depth}",
            tps,
            f"{ms:.2f} ms/step, weights {per_tok / ms / 1e6:.0f} GB/s",
        )
    for sessions, depth in _pairs(args.multi_decode):
        tps, ms = b.time_decode(sessions, depth)
        row(f"decode, {sessions} sessions at depth {depth}, aggregate", tps, f"{ms:.2f} ms/step")
    if args.profile:
        depth = max([int(d) for d in args.decode.split(",") if d.strip()] or [0])
        lines += [""] + b.profile_decode(depth)
    body = "\n".join(lines)
    print(body)
    if args.record:
        from mgserve.bench import record

        record(f"model on the GPU ({m.spec.arch})", body)
    return 0
