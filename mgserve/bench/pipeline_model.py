"""Predict a layer pipeline's prefill and decode on a machine we cannot run (the seed's 6x3090).

The model's shapes (a synthetic full-width shape, or a GGUF file) give each layer's bytes and
FLOPs (mgserve/pipeline/costs.py); the stage plan (stages.py) splits the layers over the GPUs
within their memory for the slots and context asked; a stated GPU model (gpumodel.py: memory
bandwidth and tensor throughput with efficiencies, an overhead per layer) turns each stage into
times, the PCIe lanes into links, and the pipeline model (perfmodel.py) predicts prefill of a
long prompt and decode at depth for 1 and N sessions, beside the seed's measured figures. Every
assumption is an option, printed with the result. Two parameters are then fitted to the seed
(the overhead per layer to its 1-session decode, the tensor efficiency to its prefill) to see
whether the model explains its 5-session figure from its 1-session one.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from mgserve.bench.pipeline_seed import SEED, Machine, bisect, predict_machine, table
from mgserve.config import Settings
from mgserve.core.synth.mixes import MIXES
from mgserve.core.synth.shapes import SHAPES
from mgserve.pipeline.gpumodel import GpuModel, PcieModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu, pcie = GpuModel(), PcieModel()
    p.add_argument("--shape", default="qwen4exp-flash-next", choices=sorted(SHAPES),
                   help="synthetic full-width shape (mgserve synth's)")  # fmt: skip
    p.add_argument("--model", default=None, help="a GGUF file instead of --shape")
    p.add_argument("--layers", type=int, default=None, help="fewer layers of the shape")
    p.add_argument("--experts", type=int, default=None, help="fewer experts of the shape")
    p.add_argument("--mix", default="ud-q4_k_xl", choices=sorted(MIXES), help="quant mix")
    p.add_argument("--lanes", default="8,8,4,2,4,4", help="PCIe lanes of each GPU, in order")
    p.add_argument("--gpu-memory", default="23.5GiB",
                   help="memory each GPU may use (24 GiB less the CUDA context)")  # fmt: skip
    p.add_argument("--tensor-split", default=None, help="layer shares per GPU (else balanced)")
    p.add_argument("--ctx", type=int, default=262144, help="context per slot")
    p.add_argument("--slots", type=int, default=5, help="slots the memory plan holds")
    p.add_argument("--cache-type", default="q8_0", help="K and V cache type")
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per micro-batch")
    p.add_argument("--prompt", type=int, default=250_000, help="prefill prompt tokens")
    p.add_argument("--depth", type=int, default=250_000, help="decode depth of every session")
    p.add_argument("--sessions", default="1,5", help="decoding sessions to predict")
    p.add_argument("--bandwidth", type=float, default=gpu.bandwidth_gbps, help="GPU GB/s")
    p.add_argument("--bandwidth-eff", type=float, default=gpu.bandwidth_eff,
                   help="share of the bandwidth decode reads reach")  # fmt: skip
    p.add_argument("--tflops", type=float, default=gpu.tflops,
                   help="tensor TFLOPS (3090: 71 fp16 accumulate, 35.6 fp32)")  # fmt: skip
    p.add_argument("--flops-eff", type=float, default=gpu.flops_eff,
                   help="share of the TFLOPS prompt chunks reach")  # fmt: skip
    p.add_argument("--layer-overhead-us", type=float, default=gpu.layer_overhead_us,
                   help="fixed time per layer and step (launches, small kernels)")  # fmt: skip
    p.add_argument("--pcie-gen", default="3,4", help="PCIe generations to predict (one each)")
    p.add_argument("--lane-eff", type=float, default=pcie.lane_eff,
                   help="share of a lane's raw rate a copy reaches")  # fmt: skip
    p.add_argument("--copy-latency-us", type=float, default=pcie.latency_us,
                   help="per copy: call, DMA start, event")  # fmt: skip
    p.add_argument("--p2p", action="store_true", help="peer copies (else staged through host)")
    p.add_argument("--loop-us", type=float, default=50.0,
                   help="decode: a sampled token to the host, the next step's start")  # fmt: skip
    p.add_argument("--balance", default="bytes", choices=("bytes", "prefill", "decode"),
                   help="split by decode weight bytes (the plan's default), or re-split by the "
                   "model's stage times of prefill or decode (as by measured times)")  # fmt: skip


def _machine(args: argparse.Namespace, gen: int) -> Machine:
    gpu = GpuModel(
        bandwidth_gbps=args.bandwidth,
        bandwidth_eff=args.bandwidth_eff,
        tflops=args.tflops,
        flops_eff=args.flops_eff,
        layer_overhead_us=args.layer_overhead_us,
    )
    pcie = PcieModel(gen, args.lane_eff, args.copy_latency_us, args.p2p)
    lanes = tuple(int(x) for x in args.lanes.split(","))
    return Machine(gpu, pcie, lanes, args.loop_us * 1e-6)


def _fit(args: argparse.Namespace, m: Machine, run: Callable[[Machine], dict[str, float]],
         field: str, lo: float, hi: float, key: str) -> tuple[float, dict[str, float]]:  # fmt: skip
    """The ``field`` of the GPU model in [lo, hi] that makes ``key`` the seed's, and the
    predictions with it."""

    def with_value(x: float) -> Machine:
        gpu = dataclasses.replace(m.gpu, **{field: x})  # type: ignore[arg-type]
        return dataclasses.replace(m, gpu=gpu)

    x = bisect(lambda v: run(with_value(v))[key] - SEED[key], lo, hi)
    return x, run(with_value(x))


def run(args: argparse.Namespace) -> int:
    from mgserve.bench.pipeline_seed import load_costs

    costs, label = load_costs(args)
    sessions = [int(x) for x in args.sessions.split(",")]
    settings = Settings(
        parallel=args.slots,
        ctx_size=args.ctx,
        batch_size=args.chunk,
        cache_type_k=args.cache_type,
        cache_type_v=args.cache_type,
    )
    gens = [int(x) for x in args.pcie_gen.split(",")]
    out = [f"pipeline model: {label}", ""]
    results, plan_text = {}, ""
    for gen in gens:
        m = _machine(args, gen)
        text, res = predict_machine(costs, settings, m, args, sessions)
        plan_text = plan_text or text
        results[f"PCIe {gen}.0"] = res
    first = _machine(args, gens[0])
    out += [first.describe(args, gens), "", f"(stage and link times: PCIe {gens[0]}.0)", plan_text]
    out.append("")
    out += table(results, sessions, args.prompt, args.depth)
    if 1 in sessions and args.prompt == args.depth == 250_000:  # the seed's workloads
        m = _machine(args, gens[-1])

        def once(mm: Machine) -> dict[str, float]:
            return predict_machine(costs, settings, mm, args, sessions)[1]

        us, fitted = _fit(args, m, once, "layer_overhead_us", 0.0, 5000.0, "decode 1")
        eff, pre = _fit(args, m, once, "flops_eff", 0.001, 1.0, "prefill")
        out += [
            "",
            f"fitted to the seed (PCIe {gens[-1]}.0): an overhead of {us:.0f} us per layer and "
            f"step gives its 1-session decode ({SEED['decode 1']} t/s); with it:",
        ]
        out += [f"  decode {n} sessions at {args.depth:,}: {fitted[f'decode {n}']:.1f} t/s per "
                f"session" + (f" (seed {SEED[f'decode {n}']})" if f"decode {n}" in SEED else "")
                for n in sessions if n > 1]  # fmt: skip
        out.append(
            f"  a tensor efficiency of {eff:.3f} ({eff * args.tflops:.1f} TFLOPS) gives its "
            f"prefill ({SEED['prefill']} t/s; the model's {pre['prefill']:.0f})"
        )
    text = "\n".join(out)
    print(text)
    if args.record:
        from mgserve.bench import record

        record("pipeline model: the seed's 6x3090", f"```\n{text}\n```")
    return 0
