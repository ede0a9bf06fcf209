"""Synthetic GGUF write speed: `mgserve synth` at full width, loaded by mgserve and llama.cpp.

Writes a shrunk but full-width file (real hidden size, heads, vocabulary, HC/QSA/PLE widths; fewer
layers, experts and PLE rows so it fits the disk), times the write (fsync included), proves the
file loads by describing it as ``mgserve info`` does and, with ``--llama-cpp``, by loading it in
llama-cpp-python and generating one token. The file is deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from mgserve.bench import record
from mgserve.config import Settings
from mgserve.core.gguf.info import describe
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.synth.mixes import DEFAULT_MIX, MIXES
from mgserve.core.synth.shapes import SHAPES
from mgserve.core.synth.write import write_synth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen4exp-flash-next", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    parser.add_argument("--experts", type=int, default=64, help="routed experts (default 64)")
    parser.add_argument("--ple-rows", type=int, default=4_000_000, help="PLE rows (qwen4exp)")
    parser.add_argument("--mix", default=DEFAULT_MIX, choices=sorted(MIXES), help="quant type mix")
    parser.add_argument("--out-dir", default="/tmp", help="where the file is written")
    parser.add_argument("--keep", action="store_true", help="keep the file")
    parser.add_argument("--llama-cpp", action="store_true", help="also load it in llama.cpp")


def _llama_cpp_check(path: Path) -> str:
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python is not installed"
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=os.cpu_count() or 1, verbose=False)
    t1 = time.perf_counter()
    llm.eval(llm.tokenize(b"Hello world"))
    finite = all(math.isfinite(float(x)) for x in llm.scores[llm.n_tokens - 1])
    return (
        f"loaded in {t1 - t0:.1f} s (n_vocab {llm.n_vocab()}, n_embd {llm.n_embd()}), "
        f"evaluated 1 prompt in {time.perf_counter() - t1:.1f} s, logits finite: {finite}"
    )


def run(args: argparse.Namespace) -> int:
    base = SHAPES[args.shape]
    spec = base.shrink(
        experts=args.experts,
        layers=args.layers,
        ple_rows=args.ple_rows if base.ple_layer is not None else None,
    )
    path = Path(args.out_dir) / f"synth-{args.shape}.gguf"
    res = write_synth(spec, path, seed=1, mix=args.mix)
    try:
        t0 = time.perf_counter()
        settings = Settings(ctx_size=4096, parallel=1, cache_type_k="q8_0", cache_type_v="q8_0")
        info = describe(GGUFFile(path), settings)
        t_info = time.perf_counter() - t0
        llama = _llama_cpp_check(path) if args.llama_cpp else "not run (--llama-cpp)"
    finally:
        if not args.keep:
            path.unlink()
    tensors = info[info.index("tensors:") :].split("\nKV cache")[0]
    body = (
        f"shape `{args.shape}` ({args.mix}) at full width: {spec.n_layer} layers, "
        f"{spec.n_expert} experts"
        + (f", {args.ple_rows:,} PLE rows" if base.ple_layer is not None else "")
        + "\n\n| what | value |\n|---|---|\n"
        f"| file | {res.n_bytes / 1e9:.2f} GB, {res.n_tensors} tensors |\n"
        f"| write (fsync included) | {res.seconds:.1f} s, "
        f"{res.n_bytes / 1e9 / res.seconds:.2f} GB/s |\n"
        f"| mgserve info | read and described in {t_info:.2f} s |\n"
        f"| llama.cpp | {llama} |\n\n```\n{tensors}\n```"
    )
    print(body)
    if args.record:
        record("synth (GGUF write)", body)
    return 0
