"""The CUDA linear family (dequant.cu, and the matvec / cuBLAS paths of ``linear.matmul``) against
gguf-py's dequantization and the torch version's weights, in float64 on the CPU (test_moe.py: the
experts).

Tolerances (see test_moe_torch.py for the error scales and how they were measured):
- dequantize: fp32 output within 1e-6 of each row's max |value| (the kernel and gguf-py may
  round d * sc * q - m in another order); f16 output additionally within f16 rounding,
  2^-11 |v| + 2^-24 (a wrong nibble is off by >= 1/16 of the row's range).
- linear, N <= 8 (fp32 matvec): 2e-5 of |W| @ |x|. N > 8: x and W are rounded to f16 and
  qgemm.cu (or cuBLAS) accumulates in fp32, so 2e-3 of |W| @ |x| (f16 rounding alone is
  <= 2 * 2^-11 ~ 1e-3 of it in the worst case, ~1e-5 typically).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.weights import FORMATS
from tests.cuda.test_linear_matvec import reference_weight
from tests.cuda.test_moe_torch import (
    RTOL_F16,
    RTOL_FP32,
    bound_error,
    make_weight,
)

pytestmark = pytest.mark.gpu

TYPES = sorted(FORMATS)
LINEAR_N = [1, 3, 8, 9, 100, 600]


# ---- dequantize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_gguf(cuda_ops, type_name: str) -> None:
    block = max(32, FORMATS[type_name].block)
    rng = np.random.default_rng(TYPES.index(type_name))
    worst = 0.0
    for rows, k, row0, n in [(37, 3 * block, 5, 29), (1, block, 0, 1), (130, 2560, 0, 130)]:
        w, raw = make_weight(type_name, rows, k, rng, "cuda")
        ref = reference_weight(type_name, rows, k, raw)[row0 : row0 + n].double()  # [n, k]
        row_max = ref.abs().amax(dim=1, keepdim=True)
        for dtype in (torch.float32, torch.float16):
            guard = torch.full((n + 2, k), float("nan"), dtype=dtype, device="cuda")
            cuda_ops.linear.dequantize(w, row0, n, guard[1 : n + 1])
            got = guard.cpu().double()
            assert got[0].isnan().all() and got[-1].isnan().all(), "wrote outside out"
            out = got[1 : n + 1]
            assert torch.isfinite(out).all(), f"{type_name} {dtype}: unwritten values"
            tol = 1e-6 * row_max
            if dtype == torch.float16:
                tol = tol + ref.abs() * 2.0**-11 + 2.0**-24
            excess = ((out - ref).abs() - tol).max().item()
            worst = max(worst, ((out - ref).abs() / row_max.clamp_min(1e-30)).max().item())
            assert excess <= 0, (
                f"{type_name} -> {dtype} rows [{row0}, {row0 + n}) of {rows}x{k}: "
                f"max error {(out - ref).abs().max().item():.3e} over tolerance by {excess:.3e}"
            )
    print(f"dequantize {type_name}: max error / row max {worst:.2e} (fp32 and f16 out)")


# ---- linear --------------------------------------------------------------------------------------


def check_linear(m, w, dense: torch.Tensor, n: int, rng: np.random.Generator) -> float:
    x = torch.from_numpy(rng.standard_normal((n, w.k), dtype=np.float32))  # [n, k]
    y = m.linear.matmul(x.cuda(), w)
    torch.cuda.synchronize()
    assert y.shape == (n, w.rows) and y.dtype == torch.float32
    ref = x.double() @ dense.T
    err = bound_error(y, ref, x.double().abs() @ dense.abs().T)
    tol = RTOL_FP32 if n <= 8 else RTOL_F16
    assert err <= tol, f"{w.type_name} {w.rows}x{w.k} N={n}: error {err:.2e} > {tol}"
    return err


@pytest.mark.parametrize("type_name", TYPES)
def test_linear_matches_torch(cuda_ops, type_name: str) -> None:
    """Every N regime against the torch version's weights (gguf-py, float64 product)."""
    rng = np.random.default_rng(100 + TYPES.index(type_name))
    w, _ = make_weight(type_name, 96, 512, rng, "cuda")
    dense = DenseWeights()(w).double().cpu()  # [96, 512]
    errors = [check_linear(cuda_ops, w, dense, n, rng) for n in LINEAR_N]
    print(f"linear {type_name}: errors {' '.join(f'{e:.1e}' for e in errors)} for N {LINEAR_N}")


def test_linear_row_tiles(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuBLAS prefill path with a scratch budget of 40 rows: tiles of 40, 40 and 16 rows must
    give the same result."""
    from mgserve.cuda.ops import linear_cuda

    monkeypatch.setattr(cuda_ops.linear, "cublas_prefill", True)
    rng = np.random.default_rng(7)
    w, _ = make_weight("Q6_K", 96, 512, rng, "cuda")
    dense = DenseWeights()(w).double().cpu()
    monkeypatch.setattr(linear_cuda, "SCRATCH_BYTES", 2 * 512 * 40)
    check_linear(cuda_ops, w, dense, 100, rng)


def test_linear_int8_uses_int8_matvec(cuda_ops_int8, ops, stream) -> None:
    rng = np.random.default_rng(8)
    w, _ = make_weight("Q4_K", 64, 512, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((3, 512), dtype=np.float32)).cuda()
    y = cuda_ops_int8.linear.matmul(x, w)
    torch.cuda.synchronize()
    want = ops.matvec(w, x, stream, int8=True)
    stream.sync()
    assert torch.equal(y, want)
