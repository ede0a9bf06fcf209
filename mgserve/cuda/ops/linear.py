"""The linear family: quantized linear layers, x @ W^T for a ``QuantWeight`` W, and W's rows
dequantized (for prompt GEMMs and the token embedding table).

``LinearTorch`` multiplies the dequantized (cached) matrix; each token's result is independent
of the rest of the batch on the CPU (``rows_linear``), as on the reference path.
``LinearCuda`` (linear_cuda.py) reads the GGUF blocks with the matvec kernels in decode and
dequantizes f16 tiles for cuBLAS in prefill.
"""

from __future__ import annotations

import torch

from mgserve.core.reference import ops as ref_ops
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.weights import QuantWeight


def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, k] @ w [m, k]^T. On the CPU through the reference path's ``ops.linear``, whose row
    blocks make each row's result independent of N (BLAS picks its kernel, and so its rounding,
    by the row count); elsewhere one product."""
    if x.device.type == "cpu":
        return ref_ops.linear(x, w)
    return x @ w.T


def check_linear(x: torch.Tensor, w: QuantWeight) -> None:
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"{w.name}: x has shape {list(x.shape)}, expected [N, {w.k}]")
    if x.dtype != torch.float32:
        raise ValueError(f"{w.name}: x must be float32, got {x.dtype}")


def check_rows(w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> None:
    if row0 < 0 or n_rows < 0 or row0 + n_rows > w.rows:
        raise ValueError(f"{w.name}: rows [{row0}, {row0 + n_rows}) outside [0, {w.rows})")
    if tuple(out.shape) != (n_rows, w.k):
        raise ValueError(f"{w.name}: out has shape {list(out.shape)}, expected [{n_rows}, {w.k}]")
    if out.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"{w.name}: out must be float16 or float32, got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"{w.name}: out must be contiguous")


class LinearTorch:
    """Linear layers on dequantized (cached) weights, in plain PyTorch."""

    def __init__(self, dense: DenseWeights) -> None:
        self.dense = dense

    def matmul(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        """x [N, k] fp32 -> x @ W^T [N, w.rows] fp32."""
        check_linear(x, w)
        return rows_linear(x, self.dense(w))

    def dequantize(self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0 + n_rows) of W into ``out`` [n_rows, k] (f16 or fp32)."""
        check_rows(w, row0, n_rows, out)
        out.copy_(self.dense(w)[row0 : row0 + n_rows])
        return out
