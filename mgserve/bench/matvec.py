"""Quantized matvec bandwidth on the GPU: achieved GB/s per type at qwen4exp's shapes, against the
device-to-device copy rate measured in the same run (bytes read + written).

Activation modes (--activations): fp32 runs the exact kernels; int8 quantizes x to int8 groups
and runs the int8 kernel (two launches, as a lone matvec pays); int8-pre times the int8 kernel on
x quantized beforehand (what each of several matvecs sharing one x pays). --q8-mma picks the int8
kernels of 2..8 tokens: tensor cores (on), dp4a (off), or both side by side (on,off).

Each case cycles through enough weight copies (over 4x the 60 MB L2) that every launch streams its
weights from HBM. Time per launch is the median over repeats of (events around ``--iters``
launches) / iters; bytes are weights + activations + outputs.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

# (label, rows, k): qwen4exp (n_embd 2560, expert ffn 640); a dense 9728-wide FFN for scale
SHAPES = [
    ("dense up 9728x2560", 9728, 2560),
    ("dense down 2560x9728", 2560, 9728),
    ("expert up 640x2560", 640, 2560),
    ("expert down 2560x640", 2560, 640),
]
DEFAULT_TYPES = "Q4_K,Q5_K,Q6_K,Q8_0,Q5_0,Q4_0,IQ4_XS,F16"
# the built-in Gemma 3 270M (n_embd 640, ffn 2048, 4 x 256 query heads): its head is most bytes
GEMMA_SHAPES = [
    ("gemma head 262144x640", 262144, 640),
    ("gemma up 2048x640", 2048, 640),
    ("gemma down 640x2048", 640, 2048),
    ("gemma q 1024x640", 1024, 640),
]
# the qwen4exp (Qwen3.8-Flash-Next) layer's own decode projections (n_embd 2560, 16 + 48 DeltaNet
# heads of 128, 24 + 2 attention heads of 256 with the gate, shared expert 640)
QWEN4EXP_PROJ = [
    ("deltanet qkv 10240x2560", 10240, 2560),
    ("deltanet z 6144x2560", 6144, 2560),
    ("deltanet out 2560x6144", 2560, 6144),
    ("attention q+gate 12288x2560", 12288, 2560),
    ("attention out 2560x6144", 2560, 6144),
    ("shared gate+up 1280x2560", 1280, 2560),
    ("shared down 2560x640", 2560, 640),
]
SHAPE_SETS = {"qwen4exp": SHAPES, "qwen4exp-proj": QWEN4EXP_PROJ, "gemma": GEMMA_SHAPES}
L2_SPAN = 256 << 20  # bytes of distinct weights cycled per case


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--types", default=DEFAULT_TYPES, help="comma-separated GGML types")
    parser.add_argument("--tokens", default="1,8", help="comma-separated token counts (1..8)")
    parser.add_argument(
        "--tunings",
        default="",
        help='space-separated matvec tunings "R1,RN,UNROLL" to compare (default: the built-in one)',
    )
    parser.add_argument("--iters", type=int, default=200, help="launches per timed repeat")
    parser.add_argument(
        "--shapes",
        default="qwen4exp",
        help=f"comma-separated shape sets: {', '.join(SHAPE_SETS)}",
    )
    parser.add_argument(
        "--q8-rows",
        default="2,2,128",
        help='space-separated int8-kernel shapes "R1,RN,G" to compare: rows per group of G '
        "threads (32 or 128) for 1 token and for 2..8",
    )
    parser.add_argument(
        "--q8-mma",
        default="on",
        help="comma-separated: on (int8 mma kernels for 2..8 tokens), off (dp4a kernels)",
    )
    parser.add_argument(
        "--activations",
        default="fp32,int8,int8-pre",
        help="comma-separated: fp32 (exact kernels), int8 (quantize x + int8 matvec, per call), "
        "int8-pre (int8 matvec on x quantized once outside the timing; int8 types only)",
    )


def _copy_rate(torch, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def _launcher(ops, mode: str, x, stream):
    """fn(w, stream, out) for one activation mode (see --activations)."""
    if mode == "int8-pre":
        xq = ops.q8.quantize(x, stream)
        return lambda w, s, out: ops.q8.matvec(w, xq, s, out)
    return lambda w, s, out: ops.matvec(w, x, s, out=out, int8=mode == "int8")


def _time_graph(torch, runtime, launch, ws, y, iters: int) -> float:
    """Seconds per launch, from replays of a CUDA graph of ``iters`` launches: decode replays
    graphs, and eager launches (~6 us of host time each) would hide small kernels' GPU time."""
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture):
        cs = runtime.stream_from_torch(capture)
        for i in range(iters):
            launch(ws[i % len(ws)], cs, y)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)  # ms -> s per launch
    return statistics.median(times)


def _time_eager(torch, launch, stream, ws, y, iters: int) -> float:
    ts = torch.cuda.ExternalStream(int(stream.handle))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record(ts)
        for i in range(iters):
            launch(ws[i % len(ws)], stream, y)
        end.record(ts)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from mgserve.cuda import runtime
    from mgserve.cuda.compiler import KernelCompiler
    from mgserve.cuda.dequantized import DenseWeights
    from mgserve.cuda.launch import Kernels
    from mgserve.cuda.ops.linear import LinearTorch
    from mgserve.cuda.ops.linear_cuda import LinearCuda
    from mgserve.cuda.ops.linear_tuning import INT8_TYPES, MatvecTuning
    from mgserve.cuda.weights import FORMATS, upload_bytes

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    tokens = [int(t) for t in args.tokens.split(",")]
    modes = [m.strip() for m in args.activations.split(",") if m.strip()]
    for m in modes:
        if m not in ("fp32", "int8", "int8-pre"):
            raise ValueError(f"--activations: unknown mode {m!r} (fp32, int8, int8-pre)")
    for t in types:
        if t not in FORMATS:
            raise ValueError(f"--types: unknown or unsupported type {t!r}")
    try:
        shapes = [x for name in args.shapes.split(",") for x in SHAPE_SETS[name.strip()]]
    except KeyError as e:
        raise ValueError(f"--shapes: unknown set {e} (known: {', '.join(SHAPE_SETS)})") from None
    compiler = KernelCompiler(0)
    tunings = [MatvecTuning.parse(t) for t in args.tunings.split()] or [MatvecTuning()]
    kernels, dense = Kernels(compiler), DenseWeights()
    all_ops = [LinearCuda(kernels, LinearTorch(dense), t) for t in tunings]
    mmas = [m.strip() for m in args.q8_mma.split(",") if m.strip()]
    if not mmas or any(m not in ("on", "off") for m in mmas):
        raise ValueError(f"--q8-mma {args.q8_mma!r}: expected on, off or on,off")
    q8_ops = []
    for text in args.q8_rows.split():
        try:
            r1, rn, g = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"--q8-rows {text!r}: expected R1,RN,G") from None
        for m in mmas:
            q8_ops.append(
                LinearCuda(
                    kernels, LinearTorch(dense), q8_rows=(r1, rn), q8_group=g, q8_mma=m == "on"
                )
            )
    stream = runtime.new_stream()
    ts = runtime.torch_stream(stream)
    copy_gbs = _copy_rate(torch)
    rng = np.random.default_rng(0)
    lines = [
        f"GPU: {runtime.gpu_info().name}; device-to-device copy {copy_gbs:.0f} GB/s (read+write)",
        "",
        "| type | shape | tokens | x | tuning | us/launch (graph) | GB/s | % of copy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for type_name in types:
        fmt = FORMATS[type_name]
        for label, rows, k in shapes:
            if k % fmt.block:
                continue
            w_bytes = rows * k // fmt.block * fmt.nbytes
            n_copies = max(2, L2_SPAN // w_bytes)
            # random bytes: some fp16 scales decode to NaN/inf, which timing does not care about
            raw = rng.integers(0, 256, size=w_bytes, dtype=np.uint8)
            ws = [upload_bytes(label, type_name, (k, rows), raw) for _ in range(n_copies)]
            for n_tok in tokens:
                with torch.cuda.stream(ts):
                    x = torch.randn(n_tok, k, device="cuda")  # [n_tok, k]
                    y = torch.empty(n_tok, rows, device="cuda")  # [n_tok, rows]
                runs = [(o, m) for m in modes for o in (all_ops if m == "fp32" else q8_ops)]
                for ops, mode in runs:
                    if mode != "fp32" and type_name not in INT8_TYPES:
                        continue
                    with torch.cuda.stream(ts):
                        launch = _launcher(ops, mode, x, stream)
                    for w in ws:  # warm-up: loads the kernel, touches every copy
                        launch(w, stream, y)
                    stream.sync()
                    try:
                        t = _time_graph(torch, runtime, launch, ws, y, args.iters)
                    except Exception as e:  # report, then time eager launches instead
                        print(f"graph capture failed ({e}); timing eager launches", flush=True)
                        t = _time_eager(torch, launch, stream, ws, y, args.iters)
                    nbytes = w_bytes + 4 * n_tok * (k + rows)
                    gbs = nbytes / t / 1e9
                    tu = ops.tuning
                    shape = (
                        f"{tu.rows_per_warp_1},{tu.rows_per_warp_n},{tu.unroll}"
                        if mode == "fp32"
                        else "rows {},{} per {} threads{}".format(
                            *ops.q8.rows, ops.q8.group, ", mma" if ops.q8.mma and n_tok > 1 else ""
                        )
                    )
                    lines.append(
                        f"| {type_name} | {label} | {n_tok} | {mode} | {shape} "
                        f"| {t * 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |"
                    )
                    print(lines[-1], flush=True)
            del ws
    body = "\n".join(lines)
    print(body)
    if args.record:
        from mgserve.bench import record

        record("matvec (CUDA, quantized weights)", body)
    return 0
