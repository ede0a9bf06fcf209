"""cuBLAS products of f16 operands with fp32 accumulation and fp32 output (the prompt GEMMs of
the linear and MoE families): no f16 rounding or overflow of the result. A torch without
``out_dtype`` (before 2.8, or off CUDA) gets an fp32 product of the upcast operands instead
(same inputs, slower)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _out_dtype_works(device: torch.device) -> bool:
    """Whether torch.mm takes out_dtype=float32 for f16 operands on ``device``, tried once."""
    one = torch.ones(1, 1, dtype=torch.float16, device=device)
    try:
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


@functools.cache
def _out_dtype_into_works(device: torch.device) -> bool:
    """Whether torch.bmm takes out_dtype=float32 with ``out=`` for f16 operands on ``device``."""
    one = torch.ones(1, 1, 1, dtype=torch.float16, device=device)
    out = torch.zeros(1, 1, 1, dtype=torch.float32, device=device)
    try:
        torch.bmm(one, one, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError):
        return False
    return bool(out.item() == 1.0)


def f16_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, k] f16 @ b [n, k]^T f16 -> fp32 [M, n]."""
    bt = b.transpose(-1, -2)
    if _out_dtype_works(a.device):
        return torch.mm(a, bt, out_dtype=torch.float32)
    return torch.mm(a.float(), bt.float())


def f16_bmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out [g, m, n] fp32 = a [g, m, k] f16 @ b [g, n, k]^T f16."""
    bt = b.transpose(-1, -2)
    if a.is_cuda and _out_dtype_into_works(a.device):
        torch.bmm(a, bt, out_dtype=torch.float32, out=out)
    else:
        out.copy_(torch.bmm(a.float(), bt.float()))
