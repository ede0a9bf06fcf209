"""Proof (not run in CI) that llama.cpp accepts ``mgserve synth``'s full-width layout.

Writes a shrunk but FULL-WIDTH synthetic file (real hidden size, heads, vocab, HC, QSA, PLE
widths; fewer layers, experts and PLE rows), loads it with llama-cpp-python (weights, not just
the vocabulary), generates one token, and prints sizes, timings and the outcome. Needs
llama-cpp-python and ~2 GB of disk; deletes the file afterwards unless --keep.

    python tests/data/check_synth_llama.py --shape qwen4exp-flash-next --layers 4 --experts 16 \
        --ple-rows 1000000 --out /tmp/synth/q4x-fw.gguf
"""

from __future__ import annotations

import argparse
import math
import os
import time

import llama_cpp

from mgserve.core.synth import write_synth
from mgserve.core.synth_shapes import SHAPES


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen4exp-flash-next", choices=sorted(SHAPES))
    p.add_argument("--out", default="/tmp/synth-check.gguf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ple-rows", type=int, default=1_000_000)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()

    spec = SHAPES[args.shape]
    spec = spec.shrink(
        experts=args.experts,
        layers=args.layers,
        ple_rows=args.ple_rows if spec.ple_layer is not None else None,
    )
    res = write_synth(spec, args.out, seed=1)
    print(
        f"wrote {res.path}: {res.n_tensors} tensors, {res.n_bytes / 1e9:.3f} GB in "
        f"{res.seconds:.1f} s ({res.n_bytes / 1e9 / res.seconds:.2f} GB/s)"
    )
    try:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(
            str(res.path), n_ctx=256, n_threads=2, vocab_only=False, logits_all=True, verbose=False
        )
        t1 = time.perf_counter()
        out = llm.create_completion("Hello the world", max_tokens=1, temperature=0.0)
        t2 = time.perf_counter()
        logits = llm.scores[llm.n_tokens - 1]
        finite = all(math.isfinite(float(x)) for x in logits)
        print(
            f"llama.cpp loaded {spec.arch} (n_vocab={llm.n_vocab()}, n_embd={llm.n_embd()}) in "
            f"{t1 - t0:.1f} s; 1 token in {t2 - t1:.1f} s: {out['choices'][0]['text']!r}; "
            f"last logits finite: {finite}"
        )
    finally:
        if not args.keep:
            os.remove(res.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
