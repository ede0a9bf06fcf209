"""``mgserve synth``: a random-weight GGUF at a real model's shapes, streamed to disk.

The file has the exact tensor names, shapes, quant-type mix and metadata llama.cpp expects for the
architecture (see ``shapes``/``tensors``/``mixes``), plus a synthetic BPE vocabulary, so both
llama.cpp and mgserve load it. Weights are random but finite; the text it generates is noise.
It exists to measure speed and memory at full width without downloading 100+ GB.

    mgserve synth --shape qwen4exp-flash-next --out q4x.gguf --experts 64 --ple-rows 4000000
    mgserve synth --shape qwen3next-80b-a3b --out q3n.gguf --layers 8 --mix ud-q4_k_xl
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import NamedTuple

from mgserve.core.gguf.writer import GGUFWriter, tensor_nbytes
from mgserve.core.synth.blocks import BlockSource
from mgserve.core.synth.mixes import DEFAULT_MIX, MIXES, mix_of
from mgserve.core.synth.shapes import SHAPES, ShapeSpec, metadata
from mgserve.core.synth.tensors import tensor_plan


class SynthResult(NamedTuple):
    path: Path
    n_tensors: int
    n_bytes: int  # file size
    seconds: float  # wall time of the whole write, fsync included


def planned_bytes(spec: ShapeSpec, mix: str = DEFAULT_MIX) -> int:
    """Tensor data bytes of ``spec`` in ``mix`` (the file is this plus metadata and padding)."""
    return sum(tensor_nbytes(t.shape, t.ggml_type) for t in tensor_plan(spec, mix))


def write_synth(
    spec: ShapeSpec, out: str | os.PathLike[str], seed: int = 0, mix: str = DEFAULT_MIX
) -> SynthResult:
    """Write ``spec`` in quant mix ``mix`` as a random-weight GGUF at ``out``; the data is fsynced
    before returning."""
    t0 = time.perf_counter()
    plan = tensor_plan(spec, mix)
    source = BlockSource(seed)
    path = Path(out)
    with GGUFWriter(path, spec.arch) as w:
        for key, (value, vtype) in metadata(spec, mix_of(mix).file_type).items():
            w.add(key, value, vtype)
        for t in plan:
            w.add_tensor_info(t.name, t.shape, t.ggml_type)
        w.write_header()
        for t in plan:
            w.write_tensor_chunks(
                t.name, source.chunks(t.ggml_type, tensor_nbytes(t.shape, t.ggml_type))
            )
    # the write speed we report is the disk's, not the page cache's
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return SynthResult(path, len(plan), path.stat().st_size, time.perf_counter() - t0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape", required=True, choices=sorted(SHAPES), help="model shape to write"
    )
    parser.add_argument("--out", required=True, help="output GGUF path")
    parser.add_argument(
        "--experts",
        type=int,
        default=None,
        help="routed experts per layer (default: the model's; fewer to fit a disk)",
    )
    parser.add_argument(
        "--ple-rows",
        type=int,
        default=None,
        help="rows of the qwen4exp PLE table (default: the real ~320M)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layer count (default: the model's)"
    )
    parser.add_argument(
        "--mix",
        default=DEFAULT_MIX,
        choices=sorted(MIXES),
        help=f"quant type mix (default {DEFAULT_MIX}: llama-quantize Q4_K_M's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and size, write nothing"
    )


def run(args: argparse.Namespace) -> int:
    spec = SHAPES[args.shape].shrink(
        experts=args.experts, ple_rows=args.ple_rows, layers=args.layers
    )
    size = planned_bytes(spec, args.mix)
    print(
        f"{args.shape} ({args.mix}): {spec.n_layer} layers, {spec.n_expert} experts, "
        f"{len(tensor_plan(spec, args.mix))} tensors, {size / 1e9:.2f} GB of tensor data"
    )
    if args.dry_run:
        return 0
    out = Path(args.out)
    if not out.resolve().parent.is_dir():
        raise ValueError(f"{out}: directory {out.resolve().parent} does not exist")
    st = os.statvfs(out.resolve().parent)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ValueError(
            f"{out}: needs {size / 1e9:.1f} GB but only {free / 1e9:.1f} GB are free "
            "(shrink with --experts/--ple-rows/--layers)"
        )
    res = write_synth(spec, out, args.seed, args.mix)
    print(
        f"wrote {res.path}: {res.n_bytes / 1e9:.2f} GB in {res.seconds:.1f} s "
        f"({res.n_bytes / 1e9 / res.seconds:.2f} GB/s)"
    )
    return 0
