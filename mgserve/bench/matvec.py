"""Quantized matvec bandwidth on the GPU: achieved GB/s per type at qwen4exp's shapes, against the
device-to-device copy rate measured in the same run (bytes read + written).

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


def _time_graph(torch, runtime, ops, ws, x, y, iters: int) -> float:
    """Seconds per launch, from replays of a CUDA graph of ``iters`` launches: decode replays
    graphs, and eager launches (~6 us of host time each) would hide small kernels' GPU time."""
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture):
        cs = runtime.stream_from_torch(capture)
        for i in range(iters):
            ops.matvec(ws[i % len(ws)], x, cs, out=y)
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


def _time_eager(torch, ops, stream, ws, x, y, iters: int) -> float:
    ts = torch.cuda.ExternalStream(int(stream.handle))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record(ts)
        for i in range(iters):
            ops.matvec(ws[i % len(ws)], x, stream, out=y)
        end.record(ts)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from mgserve.cuda import runtime
    from mgserve.cuda.compiler import KernelCompiler
    from mgserve.cuda.ops import CudaOps, MatvecTuning
    from mgserve.cuda.weights import FORMATS, upload_bytes

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    tokens = [int(t) for t in args.tokens.split(",")]
    for t in types:
        if t not in FORMATS:
            raise ValueError(f"--types: unknown or unsupported type {t!r}")
    compiler = KernelCompiler(0)
    tunings = [MatvecTuning.parse(t) for t in args.tunings.split()] or [MatvecTuning()]
    all_ops = [CudaOps(compiler, t) for t in tunings]
    stream = runtime.new_stream()
    ts = runtime.torch_stream(stream)
    copy_gbs = _copy_rate(torch)
    rng = np.random.default_rng(0)
    lines = [
        f"GPU: {runtime.gpu_info().name}; device-to-device copy {copy_gbs:.0f} GB/s (read+write)",
        "",
        "| type | shape | tokens | tuning R1,RN,U | us/launch (graph) | GB/s | % of copy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for type_name in types:
        fmt = FORMATS[type_name]
        for label, rows, k in SHAPES:
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
                for ops in all_ops:
                    for w in ws:  # warm-up: loads the kernel, touches every copy
                        ops.matvec(w, x, stream, out=y)
                    stream.sync()
                    try:
                        t = _time_graph(torch, runtime, ops, ws, x, y, args.iters)
                    except Exception as e:  # report, then time eager launches instead
                        print(f"graph capture failed ({e}); timing eager launches", flush=True)
                        t = _time_eager(torch, ops, stream, ws, x, y, args.iters)
                    nbytes = w_bytes + 4 * n_tok * (k + rows)
                    gbs = nbytes / t / 1e9
                    tu = ops.tuning
                    lines.append(
                        f"| {type_name} | {label} | {n_tok} "
                        f"| {tu.rows_per_warp_1},{tu.rows_per_warp_n},{tu.unroll} "
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
