"""The int8-activation matvec (matvec_q8.cu) against two references.

1. Mirror reference: x rounded exactly as ``quantize_q8`` rounds it (below, in plain torch), then
   multiplied in float64 with the reference dequantization. Only the kernel's fp32 arithmetic
   differs, so the fp32 kernels' bound applies, widened 2.5x: the K-quant path sums
   d * sc * sum(q x) and dmin * m * sum(x) separately, and those two terms can each exceed
   sum |w x| of the weights they form (RTOL_Q8 still sits 200x under a wrong nibble's error).
2. Exact reference (fp32 x): rounding moves each x_i by at most d / 2 = max|x_group| / 254, so
   |y - x @ W^T| <= (|W| @ max|x_group|) / 254 plus the fp32 slack above: a rigorous bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgserve.cuda.weights import FORMATS, upload_bytes
from tests.cuda.test_linear_matvec import linear_cuda, random_tensor, reference_weight

pytestmark = pytest.mark.gpu

RTOL_Q8 = 5e-5
INT8 = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]
# (rows, blocks per row or None for k = 2560, tokens): single block, odd rows and tokens for the
# 2-rows-per-CTA instances, a full-width row
CASES = [(1, 1, 1), (1, 1, 2), (7, 3, 3), (33, None, 8), (130, None, 1), (5, None, 2)]


def quantize_like_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors quantize_q8: per 32 values d = amax / 127 (fp32), q = roundf(x / d) with IEEE fp32
    division and C's roundf (ties away from zero, not torch.round's ties to even); q = 0 where
    d = 0. Returns int8 q [n_tok, k] and fp32 d [n_tok, k / 32]."""
    g = x.reshape(x.shape[0], -1, 32)  # [n_tok, groups, 32]
    d = g.abs().amax(dim=-1) / 127.0  # fp32 division, as on the GPU
    v = (g / d.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).abs()
    whole = v.floor()
    r = whole + (v - whole >= 0.5).float()  # v - whole is exact in fp32
    q = torch.where(d[..., None] > 0, r * g.sign(), torch.zeros_like(r))
    return q.to(torch.int8).reshape(x.shape), d


def check(ops, stream, type_name: str, rows: int, k: int, n_tok: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    raw = random_tensor(type_name, rows, k, rng)
    w = upload_bytes(f"w.{type_name}", type_name, (k, rows), raw)
    x = torch.from_numpy(rng.standard_normal((n_tok, k), dtype=np.float32))  # [n_tok, k]
    x[0, :32] = 0.0  # one all-zero group: d = 0 must give q = 0, not NaN
    out = torch.full((n_tok, rows), float("nan"), device="cuda")  # poisoned: all must be written
    torch.cuda.synchronize()
    ops.matvec(w, x.cuda(), stream, out=out, int8=True)
    stream.sync()
    y = out.cpu().double()
    assert torch.isfinite(y).all(), f"{type_name}: unwritten or non-finite outputs"

    q, d = quantize_like_kernel(x)
    xdeq = (q.double().reshape(n_tok, -1, 32) * d.double()[..., None]).reshape(n_tok, k)
    wref = reference_weight(type_name, rows, k, raw).double()  # [rows, k]
    mirror = xdeq @ wref.T  # [n_tok, rows]
    bound = xdeq.abs() @ wref.abs().T
    err = ((y - mirror).abs() / bound.clamp_min(1e-30)).max().item()
    assert err <= RTOL_Q8, f"{type_name} {rows}x{k} t={n_tok}: error vs mirror {err:.2e}"

    exact = x.double() @ wref.T
    amax = (d.double() * 127.0).repeat_interleave(32, dim=1)  # [n_tok, k]: group max per value
    loose = amax @ wref.abs().T / 254.0 * (1 + 1e-6) + RTOL_Q8 * (x.double().abs() @ wref.abs().T)
    excess = ((y - exact).abs() - loose).max().item()
    assert excess <= 0, f"{type_name} {rows}x{k} t={n_tok}: over the rounding bound by {excess}"
    return err


@pytest.mark.parametrize("type_name", INT8)
def test_matvec_q8_matches_references(ops, stream, type_name: str) -> None:
    block = FORMATS[type_name].block
    errors = []
    for i, (rows, n_blocks, n_tok) in enumerate(CASES):
        k = 2560 if n_blocks is None else n_blocks * block
        errors.append(check(ops, stream, type_name, rows, k, n_tok, seed=31 * i + len(type_name)))
    print(f"matvec int8 {type_name}: max relative error vs mirror {max(errors):.2e}")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_matvec_q8_layer_shape(ops, stream, type_name: str) -> None:
    err = check(ops, stream, type_name, rows=2560, k=9728, n_tok=1, seed=5)
    print(f"matvec int8 {type_name} 2560x9728: max relative error vs mirror {err:.2e}")


def test_quantize_q8_matches_mirror(ops, stream) -> None:
    x = torch.randn(3, 4096) * torch.logspace(-3, 3, 4096)  # [3, 4096], wide range of scales
    x[1, 64:96] = 0.0
    torch.cuda.synchronize()
    xq = ops.q8.quantize(x.cuda(), stream)
    stream.sync()
    q, d = quantize_like_kernel(x)
    assert torch.equal(xq.d.cpu(), d)
    assert torch.equal(xq.q.cpu(), q)


def test_int8_rejects_other_types(ops, stream) -> None:
    raw = random_tensor("Q4_0", 2, 64, np.random.default_rng(0))
    w = upload_bytes("w", "Q4_0", (64, 2), raw)
    with pytest.raises(ValueError, match="no int8 matvec for type Q4_0"):
        ops.matvec(w, torch.zeros(64, device="cuda"), stream, int8=True)


# every kernel shape the bench compares must compute the same function (rows past the end are
# clamped reads, never written); 3 and 8 rows: R x NT past warp_sum_split's powers of two <= 32
@pytest.mark.parametrize(
    "rows_group", [(1, 1, 128), (4, 4, 128), (2, 2, 32), (1, 4, 32), (3, 3, 128), (8, 8, 32)]
)
def test_matvec_q8_kernel_shapes(kernels, stream, rows_group: tuple[int, int, int]) -> None:
    ops = linear_cuda(kernels, q8_rows=rows_group[:2], q8_group=rows_group[2])
    for i, type_name in enumerate(INT8):
        block = FORMATS[type_name].block
        for rows, n_blocks, n_tok in [(13, 5, 1), (13, 5, 8), (3, 1, 5), (6, 80 * 32 // block, 2)]:
            check(ops, stream, type_name, rows, n_blocks * block, n_tok, seed=7 * i + rows)


def test_q8_shape_is_validated(kernels) -> None:
    with pytest.raises(ValueError, match="q8_group must be 32 or 128"):
        linear_cuda(kernels, q8_group=64)
    with pytest.raises(ValueError, match="two row counts"):
        linear_cuda(kernels, q8_rows=(0, 2))
