"""The flash prefill kernel (``attn_prefill``, ops/attention_prefill.py) through
``AttentionCuda.prefill``: against an f64 reference on the dequantized pools, and bitwise batch
invariance.

Tolerance: RTOL_FLASH = 5e-3 (attention_inputs.py) of each row's largest |output| (``close``).
The kernel rounds Q (times scale and log2 e), K and V (q8_0: value times scale) and P to f16 and
accumulates in fp32; a CPU emulation of that rounding on these random pools gives at most 2.5e-3
on q8_0 pools (scores of std ~2: a peaked softmax) and 6e-4 on f16 pools, at T = 4096. The
decode kernel per query (the ``flash_prefill = False`` path) keeps its own bound, RTOL = 2e-5.

Shapes: head dims 256 (qwen4exp: 24 query heads over 2 KV heads; Gemma 3: 4 over 1), 128 and 64;
spans of 1, 17, 64, 100 and 4096 tokens, starting at 0 or after a prefix already in the pool
(mid-tile starts); q8_0, f16 and mixed pools; sliding window and soft cap. Invariance: a query's
output is the same bits whatever span it is computed in (its own, a longer one, one starting
elsewhere, a single token) and whatever slot holds the same K/V.
"""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.cuda.ops.kv import dequant
from mgserve.cuda.pools import KVLayer
from tests.cuda.attention_inputs import RTOL, RTOL_FLASH, close, pool, randn

pytestmark = pytest.mark.gpu

_QUERY_CHUNK = 256  # reference queries per f64 score block


def reference(
    q: torch.Tensor,  # [T, H, D]
    k: KVLayer,
    v: KVLayer,
    slot: int,
    start: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, H * D] float64
    """Causal (windowed, soft-capped) softmax attention in f64 on the dequantized pool."""
    t, h, d = q.shape
    end = start + t
    kf = dequant(k, slot, slice(0, end)).double()  # [S, Hkv, D]
    vf = dequant(v, slot, slice(0, end)).double()
    n_kv = kf.shape[1]
    key_pos = torch.arange(end, device=q.device)
    outs = []
    for c0 in range(0, t, _QUERY_CHUNK):
        c1 = min(t, c0 + _QUERY_CHUNK)
        qc = q[c0:c1].double().view(c1 - c0, n_kv, h // n_kv, d)
        s = torch.einsum("tkgd,skd->kgts", qc, kf) * scale
        if softcap > 0.0:
            s = torch.tanh(s / softcap) * softcap
        q_pos = torch.arange(start + c0, start + c1, device=q.device)
        visible = key_pos[None, :] <= q_pos[:, None]
        if window > 0:
            visible &= q_pos[:, None] - key_pos[None, :] < window
        p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
        outs.append(torch.einsum("kgts,skd->tkgd", p, vf).reshape(c1 - c0, h * d))
    return torch.cat(outs)


CASES = [  # K type, V type, head dim, n_kv, n_head, start, T, window, softcap
    ("q8_0", "q8_0", 256, 2, 24, 0, 1, 0, 0.0),  # qwen4exp: one token, first position
    ("q8_0", "q8_0", 256, 2, 24, 1000, 1, 0, 0.0),  # one token after a prefix
    ("q8_0", "q8_0", 256, 2, 24, 0, 17, 0, 0.0),
    ("q8_0", "q8_0", 256, 2, 24, 1001, 17, 0, 0.0),  # mid-tile start
    ("q8_0", "q8_0", 256, 2, 24, 0, 64, 0, 0.0),
    ("q8_0", "q8_0", 256, 2, 24, 960, 64, 0, 0.0),
    ("q8_0", "q8_0", 256, 2, 24, 0, 100, 0, 0.0),
    ("q8_0", "q8_0", 256, 2, 24, 700, 100, 0, 0.0),
    ("f16", "f16", 256, 2, 24, 0, 100, 0, 0.0),
    ("f16", "f16", 256, 2, 24, 333, 17, 0, 0.0),
    ("q8_0", "f16", 256, 2, 24, 45, 100, 0, 0.0),  # mixed pools
    ("f16", "q8_0", 256, 2, 24, 45, 100, 0, 0.0),
    ("q8_0", "q8_0", 256, 1, 4, 1000, 300, 512, 0.0),  # Gemma 3: window across the span
    ("f16", "f16", 256, 1, 4, 0, 100, 0, 30.0),  # soft cap
    ("q8_0", "q8_0", 128, 2, 24, 37, 100, 0, 0.0),  # group of 12 at D=128
    ("q8_0", "q8_0", 128, 4, 16, 0, 64, 50, 20.0),  # window and soft cap
    ("f16", "f16", 64, 2, 8, 5, 100, 0, 0.0),  # GQA 4:1
    ("q8_0", "q8_0", 64, 2, 2, 0, 17, 0, 0.0),  # no GQA
]


@pytest.mark.parametrize(
    ("kt", "vt", "d", "n_kv", "n_head", "start", "t", "window", "softcap"), CASES
)
def test_prefill(
    cuda_ops,
    kt: str,
    vt: str,
    d: int,
    n_kv: int,
    n_head: int,
    start: int,
    t: int,
    window: int,
    softcap: float,
) -> None:
    k, v = pool(kt, 2, 2048, n_kv, d, seed=40), pool(vt, 2, 2048, n_kv, d, seed=41)
    q = randn(t, n_head, d, seed=42)
    kw = {"scale": 1 / math.sqrt(d), "window": window, "softcap": softcap}
    got = cuda_ops.attention.prefill(q, k, v, 1, start, **kw)
    want = reference(q, k, v, 1, start, **kw)
    close(
        f"prefill {kt}/{vt} D={d} {n_head}/{n_kv} start {start} T {t} w={window} cap={softcap}",
        got,
        want,
        RTOL_FLASH,
    )


@pytest.mark.parametrize(("kind", "start"), [("q8_0", 0), ("q8_0", 2000), ("f16", 0)])
def test_prefill_4096(cuda_ops, kind: str, start: int) -> None:
    """qwen4exp's prompt chunk: 4096 tokens, D=256, 24 query heads over 2 KV heads."""
    k, v = pool(kind, 2, 8192, 2, 256, seed=43), pool(kind, 2, 8192, 2, 256, seed=44)
    q = randn(4096, 24, 256, seed=45)
    got = cuda_ops.attention.prefill(q, k, v, 0, start, scale=1 / 16)
    close(
        f"prefill {kind} T 4096 start {start}",
        got,
        reference(q, k, v, 0, start, 1 / 16),
        RTOL_FLASH,
    )


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (100, 0.0), (0, 30.0)])
@pytest.mark.parametrize("kind", ["q8_0", "f16"])
def test_prefill_invariance(cuda_ops, kind: str, window: int, softcap: float) -> None:
    """Rows of one 300-token span at start 0 equal (bitwise) the same queries computed in shorter
    spans starting elsewhere (mid-tile, a single token, the span's tail), and in another slot
    holding the same K/V."""
    k, v = pool(kind, 3, 1024, 2, 256, seed=46), pool(kind, 3, 1024, 2, 256, seed=47)
    for c in (k, v):  # slot 2 holds slot 0's K/V
        c.values[2] = c.values[0]
        if c.quantized:
            c.scales[2] = c.scales[0]
    q = randn(300, 24, 256, seed=48)
    kw = {"scale": 1 / 16, "window": window, "softcap": softcap}
    whole = cuda_ops.attention.prefill(q, k, v, 0, 0, **kw)
    for start, t in [(0, 1), (1, 17), (100, 117), (250, 1), (255, 45), (63, 64), (299, 1)]:
        part = cuda_ops.attention.prefill(q[start : start + t], k, v, 0, start, **kw)
        diff = (part - whole[start : start + t]).abs().max().item()
        assert torch.equal(part, whole[start : start + t]), (
            f"{kind} w={window} cap={softcap}: span ({start}, {t}) differs by {diff:.3e}"
        )
    other = cuda_ops.attention.prefill(q, k, v, 2, 0, **kw)
    assert torch.equal(other, whole), f"{kind}: slot 2 (same K/V as slot 0) differs"


def test_prefill_decode_kernel_path(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flash_prefill = False``: the decode kernel per query (the fallback), at its tolerance,
    including a span long enough to run in several launches."""
    from mgserve.cuda.ops import attention_cuda

    monkeypatch.setattr(cuda_ops.attention, "flash_prefill", False)
    k, v = pool("q8_0", 2, 2048, 2, 256, seed=49), pool("q8_0", 2, 2048, 2, 256, seed=50)
    q = randn(300, 24, 256, seed=51)
    for window, softcap in [(0, 0.0), (100, 20.0)]:
        kw = {"scale": 1 / 16, "window": window, "softcap": softcap}
        got = cuda_ops.attention.prefill(q, k, v, 1, 700, **kw)
        close(f"decode-kernel prefill w={window}", got, reference(q, k, v, 1, 700, **kw), RTOL)
    monkeypatch.setattr(attention_cuda, "_PREFILL_PART_ELEMS", 11 * 24 * 4 * 256)  # 4 splits
    got = cuda_ops.attention.prefill(q, k, v, 1, 700, scale=1 / 16)
    close("decode-kernel prefill in launches of 11 queries", got,
          reference(q, k, v, 1, 700, 1 / 16), RTOL)  # fmt: skip
