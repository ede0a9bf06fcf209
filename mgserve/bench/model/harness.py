"""``ModelBench``: a model loaded on the GPU with its ``DeviceRunner``, driven step by step with
batches shaped as the scheduler shapes them, and the depth fill that puts a slot at D tokens."""

from __future__ import annotations

import argparse
import gc
import time
from functools import partial
from typing import Any

from mgserve.bench.model.tiles import is_wgmma, moe_tilings, set_moe_tiles


def stage_counts(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``--virtual-stages``: the (stages, micro-batches) to run, in order (``1,3,6x3``: 6 stages
    whose decode steps run as 3 micro-batches)."""
    text = str(getattr(args, "virtual_stages", "1"))
    try:
        counts = [tuple(int(v) for v in (x + "x1").split("x")[:2]) for x in text.split(",") if x]
    except ValueError:
        counts = []
    if not counts or min(min(c) for c in counts) < 1:
        raise ValueError(f"--virtual-stages {text!r}: stage counts >= 1, e.g. 1 or 1,3,6x3")
    return counts  # type: ignore[return-value]


def stage_label(n: int, micro: int = 1) -> str:
    """How a row names the stage count it ran on."""
    return f"{n} virtual stages" + (f", {micro} micro-batches" if micro > 1 else "")


def freeze_heap() -> None:
    """Every object alive now out of the garbage collector's sight, as the server has what it
    loaded (api/app.py), so the bench's steps see the server's collections: a full one would
    otherwise walk the model's and the vocabulary's objects on whichever step allocates past
    the threshold. ``bench model --paired R --toggle gc.freeze`` times it on and off (no
    difference on the H100 in BENCHMARKS.md, 2026-12-06 08:25)."""
    gc.collect()
    gc.freeze()


def switch_owner(ops: Any, name: str) -> tuple[Any, str]:
    """``family.attr`` or ``family.part.attr`` (e.g. linear.hgemm.wgmma): the object holding the
    setting under the backend ``ops`` and its attribute name (the object is None when a part of
    the path is missing)."""
    *path, attr = name.strip().split(".")
    owner: Any = ops if path else None
    for part in path:
        owner = getattr(owner, part, None)
    return owner, attr


def apply_setting(ops: Any, setting: str) -> None:
    """``--set family.attr=value`` on the backend ``ops``: the attribute must exist and be an
    int, float or bool, and the value parses as that type (ValueError naming what is wrong)."""
    name, eq, text = setting.partition("=")
    fam, attr = switch_owner(ops, name)
    current = getattr(fam, attr, None) if fam is not None and attr else None
    if not eq or not isinstance(current, (bool, int, float)):
        raise ValueError(
            f"--set {setting!r}: not FAMILY.ATTR=VALUE with an int, float or bool setting of an "
            "op family (e.g. deltanet.prefill_piece=1024, ple.packed_rows=false)"
        )
    text = text.strip().lower()
    try:
        if isinstance(current, bool):
            if text not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError(text)
            value: bool | int | float = text in ("true", "1", "on")
        else:
            value = type(current)(text)
    except ValueError:
        raise ValueError(f"--set {setting!r}: {text!r} is not a {type(current).__name__}") from None
    setattr(fam, attr, value)


class ModelBench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from mgserve.cuda.backend import cuda_backend, load_device_model, torch_backend
        from mgserve.cuda.graphs import BUCKETS, DRAFT_BUCKETS, POW2_BUCKETS
        from mgserve.cuda.ops.hgemm import HGemmTuning

        self.torch = torch
        self.device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        if args.model:
            from mgserve.core.gguf.reader import GGUFFile

            g: Any = GGUFFile(args.model)
        else:
            from mgserve.cuda.synth_device import SynthFile

            g = SynthFile.from_shape(
                args.shape,
                layers=args.layers,
                experts=args.experts,
                ple_rows=args.ple_rows,
                mix=args.mix,
            )
        self.source = str(g.path)
        self.metadata = g.metadata  # the tokenizer's too
        t0 = time.perf_counter()
        tilings: list[Any] = []  # --moe-tiles'
        if args.device == "cuda":
            hgemm = HGemmTuning.parse(args.hgemm) if args.hgemm else None
            self.ops = cuda_backend(
                0,
                int8=args.int8,
                cublas_prefill=args.cublas_prefill,
                hgemm=hgemm,
                pdl=not args.no_pdl,
            )
            linear: Any = self.ops.linear  # LinearCuda on --device cuda
            # --hgemm and --moe-tiles' qgemm.cu tilings tune the mma.sync kernels (hgemm.cu,
            # qgemm.cu): their wgmma twins are off for the run, qgemm's for short dense prompts
            # too (one switch); wg: tilings tune the wgmma MoE kernels and leave them on
            if hgemm is not None:
                linear.hgemm.wgmma = False
            tilings = moe_tilings(args.moe_tiles)
            if tilings and not is_wgmma(tilings[0]):  # qgemm.cu's (mma.sync)
                sets = getattr(args, "set", [])
                if any(s.split("=")[0].strip() == "linear.qgemm.wgmma" for s in sets):
                    raise ValueError("--moe-tiles times qgemm.cu; drop --set linear.qgemm.wgmma")
                linear.qgemm.wgmma = False
            if len(tilings) > 1 and not getattr(args, "paired", 0):
                raise ValueError("--moe-tiles with several tilings needs bench model --paired R")
            if len(tilings) == 1:  # one tiling (several: --paired)
                set_moe_tiles(linear.qgemm, tilings[0])
        else:
            if args.moe_tiles:
                raise ValueError("--moe-tiles: the MoE prompt kernels run on --device cuda only")
            self.ops = torch_backend()
        for setting in getattr(args, "set", []):
            apply_setting(self.ops, setting)
        linear_ops: Any = self.ops.linear  # LinearCuda where there are tilings (cuda)
        if tilings and is_wgmma(tilings[0]) and not linear_ops.qgemm.wgmma:
            raise ValueError("--moe-tiles wg:...: the wgmma MoE kernels are off (an sm_90 GPU, "
                             "without --set linear.qgemm.wgmma=false)")  # fmt: skip
        self.model = load_device_model(
            g, self.ops, self.device, args.slots, args.ctx, args.cache_type, args.cache_type
        )
        if not args.model:
            from mgserve.cuda.synth_device import release_pools

            release_pools()
        self.sync()
        self.load_s = time.perf_counter() - t0
        self.g = g
        self._buckets = (POW2_BUCKETS if args.pow2_buckets else BUCKETS) + DRAFT_BUCKETS
        self._graphs = not args.no_graphs
        self.args = args
        self.n_stages, self.micro = 0, 1
        self.kept: dict[tuple[int, int], tuple[Any, Any]] = {}  # ``switch``'s other runners
        self.runner: Any
        self.new_runner: Any
        self.step = 0
        self.vocab = self.model.spec.n_vocab
        self.use_stages(*stage_counts(args)[0])

    def use_stages(self, n: int, micro: int = 1, keep: bool = False) -> None:
        """A new runner on the model run as ``n`` virtual stages (1: the model itself; the pools
        are the model's, shared), decode steps in ``micro`` micro-batches, warmed up. ``keep``:
        the runner before stays alive for ``switch`` (``--paired``) instead of being released."""
        from mgserve.cuda.runner import DeviceRunner

        if keep and "runner" in self.__dict__:
            self.kept[(self.n_stages, self.micro)] = (self.runner, self.new_runner)
            del self.runner, self.new_runner
        run_model: Any = self.model
        if n > 1:
            from mgserve.pipeline.staged import balanced_ranges, virtual_stages

            a = self.args
            ranges = balanced_ranges(self.g, n, a.cache_type, a.cache_type)
            gbps = [float(x) for x in a.link_gbps.split(",")] if a.link_gbps else None
            run_model = virtual_stages(self.model, ranges, self.device, micro, gbps)
        self.__dict__.pop("new_runner", None)  # holds the last stages (their streams, buffers)
        if self.__dict__.pop("runner", None) is not None:  # its graphs go before the next ones
            self._release()
        self.new_runner = partial(
            DeviceRunner, run_model, self.device, graphs=self._graphs, buckets=self._buckets
        )  # another runner on the model: ``lanes=True`` for the prefill lane (bench mixed)
        self.runner = self.new_runner()
        self.n_stages, self.micro = n, micro
        self.warm_up()

    def switch(self, n: int, micro: int = 1) -> None:
        """Make the kept runner of ``n`` stages in ``micro`` micro-batches the current one (the
        current goes to the kept ones)."""
        if (n, micro) == (self.n_stages, self.micro):
            return
        self.kept[(self.n_stages, self.micro)] = (self.runner, self.new_runner)
        self.runner, self.new_runner = self.kept.pop((n, micro))
        self.n_stages, self.micro = n, micro

    def _release(self) -> None:
        """After dropping a runner: its graphs' pools and its stages' stream-keyed blocks back to
        the GPU, so the next runner starts as the first did (in the 2026-12-06 H200 run, a second
        six-stage runner built after the first prefilled 14% slower than the first)."""
        if self.device.type == "cuda":
            gc.unfreeze()  # the dropped runner's cycles were frozen with it (warm_up)
            gc.collect()
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def warm_up(self) -> None:
        """Compile every kernel (or read it from the cubin cache) and size the workspaces once, so
        no timed workload pays for it: a short prefill, then a few decode steps."""
        ub = min(self.args.ubatch, self.args.ctx // 2)
        toks = self.tokens(ub + 43, 99)
        self.run_step([self.work(0, toks[:ub], 0, True)])  # a whole ubatch: GEMM shapes, scratch
        self.run_step([self.work(0, toks[ub:], ub, True)])
        for i, t in enumerate(self.tokens(3, 98)):
            self.run_step([self.work(0, (t,), ub + 43 + i, True)])
        self.sync()
        if self.device.type == "cuda":  # (on the CPU the bench runs in tests: their heap as is)
            freeze_heap()

    def where(self) -> str:
        """Where the model runs, for a bench's header: the GPU and the backend's modes, or the
        CPU."""
        if self.device.type != "cuda":
            return "the torch backend on the CPU"
        from mgserve.cuda import runtime

        a = self.args
        gpu = runtime.gpu_info().name
        stages = f", {self.n_stages} virtual stages" if self.n_stages > 1 else ""
        return f"{gpu}, int8 {a.int8}, graphs {not a.no_graphs}, pdl {not a.no_pdl}{stages}"

    def sync(self) -> None:
        """Wait for the GPU (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    # -- building batches --------------------------------------------------------------------

    def tokens(self, n: int, seed: int) -> tuple[int, ...]:
        """``n`` random token ids (away from the vocabulary's ends), the same for the same seed."""
        g = self.torch.Generator().manual_seed(seed)
        end = min(100, self.vocab // 4)  # tiny test vocabularies have a few hundred tokens
        return tuple(self.torch.randint(end, self.vocab - end, (n,), generator=g).tolist())

    def run_step(self, work: list[Any]) -> Any:
        """One runner step of ``work`` (SeqWork items), as the scheduler would hand it over."""
        from mgserve.core.engine.contract import ScheduledBatch

        self.step += 1
        return self.runner.run(ScheduledBatch(self.step, tuple(work)))

    def work(
        self,
        slot: int,
        tokens: tuple[int, ...],
        start: int,
        sample: bool,
        sampling: Any = None,
        grammar: Any = None,
    ) -> Any:
        """One session's share of a step: ``tokens`` at positions from ``start``; greedy unless
        ``sampling`` (SamplingParams), under ``grammar`` (from its first step at 0) if given."""
        from mgserve.core.engine.contract import SamplingParams, SeqWork

        return SeqWork(
            slot=slot, request_id=f"bench-{slot}", tokens=tokens, start=start, sample=sample,
            sampling=sampling or SamplingParams(temperature=0.0), new_sequence=start == 0,
            grammar=grammar,
        )  # fmt: skip

    # -- depth -------------------------------------------------------------------------------

    def fill(self, slot: int, depth: int) -> None:
        """Bring ``slot`` to ``depth`` tokens (a new sequence)."""
        if depth == 0:
            self.model.begin_sequence(slot)
            return
        if self.args.fill == "prefill":
            self.prefill(slot, 0, depth)
            return
        from mgserve.cuda.fill import fill_synthetic

        self.run_step([self.work(slot, self.tokens(1, slot), 0, False)])  # new sequence at 0
        fill_synthetic(self.model, slot, depth)

    def prefill(self, slot: int, start: int, n: int) -> None:
        """A prompt of ``n`` tokens into ``slot`` from position ``start``, a ubatch per step."""
        ub = self.args.ubatch
        toks = self.tokens(n, 7 + slot)
        for c in range(0, n, ub):
            part = toks[c : c + ub]
            self.run_step([self.work(slot, part, start + c, c + ub >= n)])
