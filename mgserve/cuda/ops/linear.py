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
from mgserve.cuda.ops.linear_tuning import Q8Activations
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


def check_epilogue(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> None:
    """bias [w.rows] and residual [N, w.rows], float32, when given."""
    if bias is not None and (bias.shape != (w.rows,) or bias.dtype != torch.float32):
        raise ValueError(f"{w.name}: bias must be float32 [{w.rows}], got {list(bias.shape)}")
    want = (x.shape[0], w.rows)
    if residual is not None and (residual.shape != want or residual.dtype != torch.float32):
        raise ValueError(
            f"{w.name}: residual must be float32 {list(want)}, got {list(residual.shape)}"
        )


def epilogue(
    y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """residual + (y + bias), the reference's order (``x + ops.linear(h, w, b)``)."""
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


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

    def matmul(
        self,
        x: torch.Tensor,
        w: QuantWeight,
        *,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        xq: Q8Activations | None = None,
    ) -> torch.Tensor:
        """x [N, k] fp32 -> residual + (x @ W^T + bias) [N, w.rows] fp32 (bias [rows] and
        residual [N, rows] optional). ``xq``: x rounded by ``quantize`` (shared by the products
        of one x; ignored here)."""
        check_linear(x, w)
        check_epilogue(x, w, bias, residual)
        return epilogue(rows_linear(x, self.dense(w)), bias, residual)

    def quantize(self, x: torch.Tensor) -> Q8Activations | None:
        """The int8 form of x that several ``matmul`` calls on x may share: none here (fp32)."""
        return None

    def fused_xq(self, n: int, k: int) -> bool:
        """Whether the producer of an [n, k] activation should write its int8 form (``quantize``'s
        bits) for the products that read it: never here (fp32)."""
        return False

    def dequantize(self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0 + n_rows) of W into ``out`` [n_rows, k] (f16 or fp32)."""
        check_rows(w, row0, n_rows, out)
        if out.device.type == "meta":  # the plan's trace of a CUDA load: the kernel allocates
            return out  # nothing, and there are no values (plan_trace.py)
        out.copy_(self.dense(w)[row0 : row0 + n_rows])
        return out
