"""The CUDA dense attention decode (``AttentionCuda``) against the torch one (``AttentionTorch``,
which tests/cuda/test_attention_torch.py checks against the reference) on the same GPU pools;
test_attention_prefill.py covers prefill.

Tolerance: the decode kernel computes S = QK and PV on tensor cores with f16 hi + lo splits of
the non-exact operand (K/V values are exact in f16), so it agrees with fp32 torch to ~1e-6 of
each row's largest output (bound 2e-5).

Cases: the small ones of the CPU tests (q8_0 / f16 / mixed pools, GQA, window, soft cap,
lengths around tile and chunk edges, zero-length rows) plus the target shapes: D=256, Hkv=2,
H=24 at lengths 1..70000 in one batch (and each row alone: results must not depend on the
batch), and Gemma 3 270M (D=256, Hkv=1, H=4, window 512). test_qsa.py captures the dense decode
into a CUDA graph beside QSA decode.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.cuda.attention_inputs import close, i32, pool, randn

pytestmark = pytest.mark.gpu


# ---- decode -----------------------------------------------------------------------------------

SMALL = [  # K type, V type, head dim, n_kv, n_head, window, softcap
    ("q8_0", "q8_0", 64, 2, 8, 0, 0.0),  # GQA 4:1
    ("f16", "f16", 64, 2, 4, 0, 0.0),  # GQA 2:1
    ("q8_0", "f16", 64, 1, 4, 7, 0.0),  # mixed pools, sliding window
    ("q8_0", "q8_0", 128, 2, 24, 50, 0.0),  # group of 12, window across chunks
    ("f16", "f16", 256, 1, 16, 0, 30.0),  # the largest group (16), soft cap
    ("q8_0", "q8_0", 256, 2, 4, 0, 20.0),
]
# (slot, length): zero (padding), 1, around warp rows (16) / tiles (64) / chunks (256), the pool
SMALL_ROWS = [
    (0, 0),
    (1, 1),
    (2, 31),
    (0, 32),
    (1, 33),
    (2, 64),
    (0, 65),
    (1, 257),
    (2, 300),
    (0, 129),
    (1, 16),
]


@pytest.mark.parametrize(("kt", "vt", "d", "n_kv", "n_head", "window", "softcap"), SMALL)
def test_decode_small(
    cuda_ops,
    torch_ops,
    kt: str,
    vt: str,
    d: int,
    n_kv: int,
    n_head: int,
    window: int,
    softcap: float,
) -> None:
    k, v = pool(kt, 3, 300, n_kv, d, seed=3), pool(vt, 3, 300, n_kv, d, seed=4)
    q = randn(len(SMALL_ROWS), n_head, d, seed=5)
    slots, lengths = i32([s for s, _ in SMALL_ROWS]), i32([n for _, n in SMALL_ROWS])
    kw = {"scale": 1 / math.sqrt(d), "window": window, "softcap": softcap}
    got = cuda_ops.attention.decode(q, k, v, slots, lengths, **kw)
    want = torch_ops.attention.decode(q, k, v, slots, lengths, **kw)
    close(f"decode {kt}/{vt} D={d} {n_head}/{n_kv} w={window} cap={softcap}", got, want)
    assert not got[0].any(), "a zero-length row must give zeros"


def test_decode_target_shapes_and_batch_invariance(cuda_ops, torch_ops) -> None:
    """qwen4exp's full-attention shape over very different depths in one batch; each session's
    result must be bit-identical alone and in the batch."""
    lengths_l = [1, 31, 32, 33, 4097, 70000]
    k, v = pool("q8_0", 6, 70016, 2, 256, seed=6), pool("q8_0", 6, 70016, 2, 256, seed=7)
    q = randn(6, 24, 256, seed=8)
    slots, lengths = i32([5, 0, 1, 2, 3, 4]), i32(lengths_l)
    got = cuda_ops.attention.decode(q, k, v, slots, lengths, scale=1 / 16)
    close(
        "decode D=256 24/2 q8_0 1..70000",
        got,
        torch_ops.attention.decode(q, k, v, slots, lengths, scale=1 / 16),
    )
    for i in range(6):
        alone = cuda_ops.attention.decode(
            q[i : i + 1], k, v, slots[i : i + 1], lengths[i : i + 1], scale=1 / 16
        )
        assert torch.equal(alone[0], got[i]), (
            f"row {i} (length {lengths_l[i]}) depends on the batch"
        )


@pytest.mark.parametrize("kind", ["q8_0", "f16"])
def test_decode_gemma_shapes(cuda_ops, torch_ops, kind: str) -> None:
    """Gemma 3 270M: D=256, one KV head, 4 query heads, sliding window 512 on some layers."""
    k, v = pool(kind, 6, 4096, 1, 256, seed=9), pool(kind, 6, 4096, 1, 256, seed=10)
    q = randn(6, 4, 256, seed=11)
    slots, lengths = i32([0, 1, 2, 3, 4, 5]), i32([1, 300, 512, 513, 2000, 4096])
    for window in (0, 512):
        kw = {"scale": 1 / 16, "window": window}
        got = cuda_ops.attention.decode(q, k, v, slots, lengths, **kw)
        close(
            f"gemma decode {kind} window {window}",
            got,
            torch_ops.attention.decode(q, k, v, slots, lengths, **kw),
        )
