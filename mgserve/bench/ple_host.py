"""``mgserve bench ple-host``: the host's PLE work of one qwen4exp decode step, on the CPU.

A served decode step takes longer than its graph replayed alone (``bench model``'s decode rows:
6.21 against 5.64 ms for one session on an H100, 2026-12-06): the sampling kernels, the copies of
the ids and inputs, and the host's work between steps. For qwen4exp part of that host work is the
PLE rows: each session's n-gram contexts, their hash into ``n_heads`` table rows, and those rows
read and decoded to float32. This times each piece at the real model's PLE row shape (3-grams, 16
heads of 160 values) for 1..S sessions on a random in-memory table of one type (``np.take``: the
served path reads the memory-mapped file), and the same rows through gguf's dequantization beside
the project's numpy decoding (``ple_rows.decode_blocks``, the same bits), median of repeats.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from mgserve.bench import median_us

TABLE_ROWS = 200_000  # rows of the random table (the real one has ~4M; a row read costs the same)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--type", default="Q5_0", help="the table's type (a Q4_K_M file's: Q5_0)")
    parser.add_argument("--sessions", default="1,5", help="comma-separated session counts")
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timing")


def _row(s: int, spec: Any, table: np.ndarray, type_name: str, qtype: Any,
         rng: np.random.Generator, repeat: int) -> str:  # fmt: skip
    """The table line of ``s`` sessions: each piece's microseconds per step."""
    from gguf import quants

    from mgserve.core.reference import ple, ple_rows

    toks = rng.integers(0, 248000, s)
    hists = rng.integers(0, 248000, (s, spec.ngram - 1))
    ctx = ple.decode_contexts(toks, hists, spec)
    rows = ple.hash_contexts(ctx, spec).reshape(-1)
    raw = np.take(table, rows, axis=0)
    ours, theirs = ple_rows.decode_blocks(raw, type_name), quants.dequantize(raw, qtype)
    assert np.array_equal(ours.view(np.uint32), theirs.reshape(ours.shape).view(np.uint32))
    return (
        f"| {s} | {median_us(lambda: ple.decode_contexts(toks, hists, spec), repeat):.1f} "
        f"| {median_us(lambda: ple.hash_contexts(ctx, spec), repeat):.1f} "
        f"| {median_us(lambda: np.take(table, rows, axis=0), repeat):.1f} "
        f"| {median_us(lambda: ple_rows.decode_blocks(raw, type_name), repeat):.1f} "
        f"| {median_us(lambda: quants.dequantize(raw, qtype), repeat):.1f} |"
    )


def run(args: argparse.Namespace) -> int:
    from gguf import GGMLQuantizationType

    from mgserve.bench import record
    from mgserve.core.gguf.hparams_qwen4exp import PleSpec
    from mgserve.core.reference import ple_rows
    from mgserve.core.synth.shapes import ple_layer_multipliers

    if args.type not in ple_rows.NUMPY_BLOCKS:
        raise ValueError(f"--type {args.type}: one of {', '.join(ple_rows.NUMPY_BLOCKS)}")
    head_dim, heads, eos, vocab = 160, 16, 248046, 248320
    sizes = tuple(TABLE_ROWS // heads - 7 * h for h in range(heads))  # (not primes: timing only)
    offsets = tuple(int(o) for o in np.cumsum((0, *sizes[:-1])))
    mult = tuple(ple_layer_multipliers(vocab, 3))  # each product < 2^63, as the hash needs
    spec = PleSpec(1, 3, heads // 2, 4, eos, head_dim, mult, offsets, sizes)
    rng = np.random.default_rng(0)
    block = ple_rows.PACKED[args.type][0]
    table = rng.integers(0, 256, size=(TABLE_ROWS, head_dim // 32 * block), dtype=np.uint8)
    table.reshape(TABLE_ROWS, -1, block)[..., :2] = np.frombuffer(
        np.float16(0.01).tobytes(), dtype=np.uint8
    )  # finite scales
    qtype = GGMLQuantizationType[args.type]
    lines = [
        f"PLE host work of a decode step: 3-grams, {heads} heads of {head_dim} values, a "
        f"{args.type} table; microseconds per step (median of 5 x {args.repeat} calls)",
        "",
        "| sessions | contexts | hash | row bytes | rows decoded (numpy) | rows decoded (gguf) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in (int(x) for x in args.sessions.split(",")):
        lines.append(_row(s, spec, table, args.type, qtype, rng, args.repeat))
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.record:
        record("PLE host work of a decode step (CPU)", "\n".join(lines))
    return 0
