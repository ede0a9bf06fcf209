"""The torch linear family (``LinearTorch``) against gguf-py's dequantization, in float64, on the
CPU (CI); error scales as in test_moe_torch.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgserve.cuda.backend import torch_backend
from mgserve.cuda.weights import FORMATS
from tests.cuda.test_linear_matvec import reference_weight
from tests.cuda.test_moe_torch import RTOL_FP32, TYPES, bound_error, make_weight


@pytest.mark.parametrize("type_name", TYPES)
def test_linear_torch_matches_reference(type_name: str) -> None:
    rng = np.random.default_rng(TYPES.index(type_name))
    k = 2 * max(32, FORMATS[type_name].block)
    w, raw = make_weight(type_name, 7, k, rng)
    x = torch.from_numpy(rng.standard_normal((5, k), dtype=np.float32))  # [5, k]
    y = torch_backend().linear.matmul(x, w)
    assert y.shape == (5, 7) and y.dtype == torch.float32
    wref = reference_weight(type_name, 7, k, raw).double()
    err = bound_error(y, x.double() @ wref.T, x.double().abs() @ wref.abs().T)
    assert err <= RTOL_FP32, f"{type_name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dequantize_torch_rows(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(3)
    w, raw = make_weight("Q4_K", 9, 512, rng)
    out = torch.empty(4, 512, dtype=dtype)
    torch_backend().linear.dequantize(w, 3, 4, out)
    ref = reference_weight("Q4_K", 9, 512, raw)[3:7]
    assert torch.equal(out, ref.to(dtype))
