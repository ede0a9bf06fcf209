"""``mgserve bench pipeline-dist``: a layer pipeline across processes against one process.
(issue 14)

Each run starts P processes on this host, joined by ``torch.distributed`` as ``mgserve serve``
joins them (gloo on the CPU, NCCL with ``--device cuda``: one GPU per rank), each with T CPU
threads; rank 0 drives the scheduler and its ``Leader`` runner step by step as the engine does
(bench/turn.py's loop), the other ranks run ``lockstep.follow``: the serving code, less HTTP.
A run of one process is the same code with one stage (``DistTransport`` of one rank), so the
runs differ only in the split.

Measured on rank 0, on synthetic token ids: (1) prefill: one prompt of ``--prompt`` tokens in
chunks of ``--ubatch``, from submission to its first token; (2) decode: ``--sessions`` sessions
of 32-token prompts decoding together, the steps' mean once every session decodes. Greedy tokens
must be the same in every run (the split changes no arithmetic); a run whose tokens differ is
reported so; so are the stages' busy fractions and overlap in each phase (stage_stats.py).
The speed-up of P stages comes from overlap: stage 0 computes prompt chunk c + 1 (a
decode step's micro-batch j + 1) while stage 1 computes chunk c (micro-batch j); with balanced
stages and C chunks a perfect pipeline of P stages takes (C + P - 1) / C of one stage's time.

On GPUs (``--device cuda``) rank r takes the r-th GPU this process sees, NCCL carries the
hand-offs (by peer copies where the GPUs reach each other; ``--no-p2p`` forces host memory, the
PCIe-without-P2P case) and decode steps replay CUDA graphs; ``--dist-backend gloo`` lets ranks
share one GPU (hand-offs through the host). ``--shape`` makes a synthetic model on each rank,
with the same bytes everywhere, so a full-width model needs no file (README: the runs to make).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import queue
import socket
import time
from typing import Any

from mgserve.bench import record
from mgserve.bench.pipeline_table import table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or built-in name (default: the "
                        "built-in model)")  # fmt: skip
    parser.add_argument("--runs", default="1x1,1x2,2x1",
                        help="runs, in order: PxT = P processes of T threads each, PxTmM: decode "
                        "steps in M micro-batches (default 1x1,1x2,2x1)")  # fmt: skip
    parser.add_argument("--prompt", type=int, default=2048, help="prefill: prompt tokens")
    parser.add_argument("--ubatch", type=int, default=256, help="prompt tokens per step")
    parser.add_argument("--sessions", type=int, default=4, help="decode: sessions at once")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps timed")
    parser.add_argument(
        "--decode-depth",
        type=int,
        default=32,
        help="decode: each session's prompt tokens, so it decodes at this depth",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: rank r on the r-th GPU this process sees")  # fmt: skip
    parser.add_argument(
        "--dist-backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL on GPUs, gloo on the CPU; gloo with --device cuda: "
        "hand-offs through the host (ranks may share a GPU)",
    )
    parser.add_argument(
        "--no-p2p",
        action="store_true",
        help="NCCL without peer copies (NCCL_P2P_DISABLE=1): through host memory",
    )
    parser.add_argument(
        "--shape",
        default=None,
        help="a synthetic model of this shape "
        "(bench model's; made on each rank, no file) instead of --model",
    )
    parser.add_argument("--layers", type=int, default=None, help="with --shape: layer count")
    parser.add_argument("--experts", type=int, default=None, help="with --shape: routed experts")
    parser.add_argument("--ple-rows", type=int, default=None, help="with --shape: PLE rows")
    parser.add_argument("--tensor-split", "-ts", default=None,
                        help="the ranks' layer shares, as serve's (default: balanced by decode "
                        "weight bytes)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunSpec:
    processes: int
    threads: int
    micro: int = 1

    @classmethod
    def parse(cls, text: str) -> list[RunSpec]:
        out = []
        for item in (x for x in text.split(",") if x):
            try:
                pt, _, m = item.partition("m")
                p, t = (int(v) for v in pt.split("x"))
                out.append(cls(p, t, int(m) if m else 1))
            except ValueError:
                raise ValueError(f"--runs {text!r}: items like 2x1 or 2x1m2") from None
            if min(out[-1].processes, out[-1].threads, out[-1].micro) < 1:
                raise ValueError(f"--runs {text!r}: counts >= 1")
        if not out:
            raise ValueError("--runs: at least one run")
        return out

    def name(self) -> str:
        micro = f", decode in {self.micro} micro-batches" if self.micro > 1 else ""
        return f"{self.processes} process(es) x {self.threads} thread(s){micro}"


def _settings(args: argparse.Namespace, spec: RunSpec, rank: int, port: int) -> Any:
    from mgserve.config import Settings

    return Settings(
        model=args.model, device=args.device, parallel=max(1, args.sessions),
        ctx_size=max(args.prompt, args.decode_depth) + 64, batch_size=args.ubatch,
        threads=spec.threads, spec="off",
        dist_world_size=spec.processes, dist_rank=rank, dist_init=f"tcp://127.0.0.1:{port}",
        pipeline_micro_batches=spec.micro, prefill_lane="off",
        tensor_split=args.tensor_split if spec.processes > 1 else None,
    )  # fmt: skip


def _rank(args: argparse.Namespace, spec: RunSpec, rank: int, port: int, out: Any,
          gpus: list[str]) -> None:  # fmt: skip
    """One process of a run: rank 0 measures and puts its figures on ``out``; others follow."""
    import logging

    from mgserve import env
    from mgserve.pipeline.lockstep import follow
    from mgserve.pipeline.rendezvous import Rendezvous

    if gpus:  # before CUDA starts in this process
        env.show_only_gpu(gpus[rank % len(gpus)])
    if args.no_p2p:
        env.nccl_without_p2p()
    logging.basicConfig(level=logging.WARNING)
    settings = _settings(args, spec, rank, port)
    rv = Rendezvous(rank, spec.processes, settings.dist_init, args.dist_backend)
    if rank:
        follow(settings, rv, _model(args))
        return
    out.put(_lead(args, settings, rv))


def _model(args: argparse.Namespace) -> Any:
    """The model every rank loads its stage of: a synthetic ``--shape`` (the same bytes on every
    rank: cuda/loader.py), or the GGUF file."""
    from mgserve.core.builtin_models import resolve_model
    from mgserve.core.gguf.reader import GGUFFile

    if args.shape is None:
        return GGUFFile(resolve_model(args.model))
    from mgserve.cuda.synth_device import SynthFile

    return SynthFile.from_shape(args.shape, layers=args.layers, experts=args.experts,
                                ple_rows=args.ple_rows)  # fmt: skip


def _lead(args: argparse.Namespace, settings: Any, rv: Any) -> dict[str, Any]:
    import torch

    from mgserve.bench.mixed import GREEDY
    from mgserve.core.engine.contract import Request
    from mgserve.core.engine.scheduler import Scheduler
    from mgserve.pipeline.lockstep import Leader, stage_runner
    from mgserve.pipeline.perfmodel import check_run
    from mgserve.pipeline.rendezvous import agree, join
    from mgserve.pipeline.stage_stats import between, every_stage, summary

    device = args.device
    control = join(rv, device)
    g = _model(args)
    runner, model, settings = stage_runner(g, settings, device, rv)
    leader = Leader(runner, control, agree(control, settings, g, runner.checkpoint_nbytes))
    sched = Scheduler(settings.parallel, settings.ctx_size, settings.batch_size,
                      rewindable=model.rewindable)  # fmt: skip
    vocab = model.spec.n_vocab
    gen = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()

    marks: dict[str, Any] = {}  # every stage's figures at points of the runs (stage_stats.py)

    def mark(key: str) -> None:  # once: it waits for the followers' figures (``every_stage``)
        if key not in marks:
            marks[key] = every_stage(runner.model)

    def serve(reqs: list[Request], at: str) -> tuple[dict[str, list[int]], list[float], float]:
        """``reqs`` to their ends: tokens by request, the seconds of each step in which every
        request decoded, and the seconds to the first token of the first request; the figures
        at the first token (``at`` + "first"), after the first all-decoding step (+ "dec") and
        after the last (+ "decend"), so "dec" to "decend" are the steps after the first."""
        for r in reqs:
            sched.add(r)
        tokens: dict[str, list[int]] = {r.id: [] for r in reqs}
        steps, first, t0 = [], 0.0, time.perf_counter()
        while sched.has_work():
            batch = sched.schedule()
            assert batch is not None
            decoding = sum(1 for w in batch.work if len(w.tokens) == 1 and w.start > 0)
            if decoding < len(reqs) and at + "dec" in marks:
                mark(at + "decend")  # a session has finished: the all-decoding steps are over
            s0 = time.perf_counter()
            result = leader.run(batch)
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            sched.observe(batch.step, now - s0)
            if decoding == len(reqs):
                steps.append(now - s0)
                mark(at + "dec")
            for ev in sched.apply(result):
                if ev.token is not None:
                    first = first or now - t0
                    tokens[ev.request_id].append(ev.token)
            if first:
                mark(at + "first")
        if at + "dec" in marks:
            mark(at + "decend")
        return tokens, steps, first

    serve([Request("warm", prompt(2 * settings.batch_size), GREEDY, max_tokens=4)], "warm")
    long = Request("long", prompt(args.prompt), GREEDY, max_tokens=2)
    f0 = every_stage(runner.model)
    long_tokens, _, ttft = serve([long], "long")
    short = [Request(f"s{i}", prompt(args.decode_depth), GREEDY, max_tokens=args.decode_steps + 2)
             for i in range(args.sessions)]  # fmt: skip
    decode_tokens, steps, _ = serve(short, "short")
    leader.close()  # the followers' last figures come first
    pre = between(f0, marks["longfirst"])  # the long prompt's chunks
    dec = between(marks["shortdec"], marks["shortdecend"])  # the timed steps: steps[1:]
    timed = steps[1:] or steps  # the first may be a prompt's last token's own step
    step_s = sum(timed) / max(1, len(timed))
    model = check_run(pre.busy, args.prompt, args.ubatch, dec.busy, dec.steps,
                      args.sessions, settings.pipeline_micro_batches)  # fmt: skip
    return {
        "ttft": ttft, "prefill": args.prompt / ttft, "decode": args.sessions / step_s,
        "step_ms": step_s * 1e3, "ranges": [list(r) for r in runner.model.ranges],
        "stages": [summary(pre), summary(dec)], "model": model,
        "tokens": [long_tokens["long"], *decode_tokens.values()],
    }  # fmt: skip


def _run(args: argparse.Namespace, spec: RunSpec) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:  # a free port for the ranks' meeting place
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gpus: list[str] = []
    if args.device == "cuda":
        from mgserve.machine import gpu_ids

        gpus = gpu_ids()
        nccl = args.dist_backend != "gloo"
        if not gpus or (nccl and len(gpus) < spec.processes):
            raise ValueError(f"{spec.name()}: NCCL needs a GPU per rank and {len(gpus)} are here "
                             "(--dist-backend gloo lets ranks share one)")  # fmt: skip
    procs = [ctx.Process(target=_rank, args=(args, spec, r, port, out, gpus), daemon=True)
             for r in range(spec.processes)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        while True:  # rank 0's figures, unless a rank dies first
            try:
                result: dict[str, Any] = out.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode]
                if dead:
                    raise RuntimeError(f"{spec.name()}: a rank exited with {dead}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"{spec.name()}: a rank exited with {bad}")
    return result


def run(args: argparse.Namespace) -> int:
    specs = RunSpec.parse(args.runs)
    if args.ubatch < 1 or args.prompt < args.ubatch or min(args.sessions, args.decode_depth) < 1:
        raise ValueError("--prompt >= --ubatch >= 1, --sessions and --decode-depth >= 1")
    results = [(s, _run(args, s)) for s in specs]
    base = results[0][1]
    text = table(args, [(s.name(), r) for s, r in results])
    print(text)
    if args.record:
        record("layer pipeline across processes (torch.distributed)", text)
    return 0 if all(r["tokens"] == base["tokens"] for _, r in results) else 1
