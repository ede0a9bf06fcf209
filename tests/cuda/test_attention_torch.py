"""The torch dense attention ops (``AttentionTorch``) against the reference path on the CPU (runs
in CI): attention_decode / attention_prefill equal ``ops.attention`` on the dequantized cache of a
``World`` (tests/cuda/kv_world.py): GQA 4:1 and 2:1, sliding window, soft cap, q8_0 and f16
pools, a zero-length padding row, prefill chunks starting mid-way (whole and in query chunks),
and prefill rows equal to decode steps."""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.core.reference import ops
from mgserve.cuda.ops import attention as attention_ops
from tests.cuda.kv_world import World, close, rand

DECODE_CASES = [  # cache type, n_kv, n_head, head dim, window, softcap
    ("q8_0", 2, 8, 64, 0, 0.0),  # GQA 4:1
    ("f16", 2, 4, 64, 0, 0.0),  # GQA 2:1
    ("q8_0", 1, 4, 32, 7, 0.0),  # sliding window (Gemma-like: one KV head)
    ("f16", 2, 8, 32, 0, 30.0),  # soft cap
    ("q8_0", 2, 4, 64, 50, 20.0),  # both
]


@pytest.mark.parametrize(("cache_type", "n_kv", "n_head", "d", "window", "softcap"), DECODE_CASES)
def test_attention_decode_matches_reference(
    cache_type: str, n_kv: int, n_head: int, d: int, window: int, softcap: float
) -> None:
    n_ctx = 150
    w = World(cache_type, n_ctx, n_kv, d, [97, 150, 3], seed=3)
    rows = [(2, 3), (0, 97), (1, 150), (0, 1), (1, 0), (1, 64)]  # (slot, length); 0: padding
    q = rand(len(rows), n_head, d, seed=4)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lengths = torch.tensor([n for _, n in rows], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    kw = {"scale": scale, "window": window, "softcap": softcap}
    got = w.ops.attention.decode(q, w.k, w.v, slots, lengths, **kw)
    assert got.shape == (len(rows), n_head * d)
    for i, (s, n) in enumerate(rows):
        if n == 0:
            assert not got[i].any(), "a zero-length row must give zeros"
            continue
        keys, values = w.keys(s, n)
        want = ops.attention(q[i : i + 1], keys, values, torch.tensor([n - 1]), **kw)[0]
        close(f"row {i} (slot {s}, length {n})", got[i], want)


PREFILL_CASES = [  # cache type, n_kv, n_head, start, T, window, softcap
    ("q8_0", 2, 8, 0, 60, 0, 0.0),
    ("f16", 2, 4, 37, 45, 0, 0.0),
    ("q8_0", 1, 4, 70, 30, 16, 0.0),
    ("f16", 2, 8, 5, 40, 0, 25.0),
]


@pytest.mark.parametrize(
    ("cache_type", "n_kv", "n_head", "start", "t", "window", "softcap"), PREFILL_CASES
)
def test_attention_prefill_matches_reference(
    cache_type: str,
    n_kv: int,
    n_head: int,
    start: int,
    t: int,
    window: int,
    softcap: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, end = 64, start + t
    w = World(cache_type, 120, n_kv, d, [end, 120, 11], seed=5)
    q = rand(t, n_head, d, seed=6)
    kw = {"scale": 0.125, "window": window, "softcap": softcap}
    keys, values = w.keys(0, end)
    want = ops.attention(q, keys, values, torch.arange(start, end), **kw)
    close("prefill", w.ops.attention.prefill(q, w.k, w.v, 0, start, **kw), want)
    monkeypatch.setattr(attention_ops, "_SCORE_ELEMS", 7 * n_head * end)  # force query chunks
    close("prefill in chunks", w.ops.attention.prefill(q, w.k, w.v, 0, start, **kw), want)


def test_prefill_rows_equal_decode() -> None:
    """A prefill chunk's query j equals a decode step of the same session at that position."""
    w = World("q8_0", 64, 2, 32, [64, 1, 1], seed=7)
    q = rand(20, 4, 32, seed=8)
    pre = w.ops.attention.prefill(q, w.k, w.v, 0, 30, scale=0.2, window=9)
    dec = w.ops.attention.decode(
        q,
        w.k,
        w.v,
        torch.zeros(20, dtype=torch.int32),
        torch.arange(31, 51, dtype=torch.int32),
        scale=0.2,
        window=9,
    )
    close("prefill vs decode", pre, dec)
