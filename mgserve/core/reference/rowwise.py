"""Elementwise transcendental functions whose result for a row does not depend on the other rows.

PyTorch's CPU kernels run an elementwise op over a contiguous tensor in SIMD blocks (2 vectors,
32 floats with AVX-512) and finish the tail with the scalar function; the two are different
approximations of exp/log/sigmoid, so a value's rounding depends on its position in the whole
tensor. A [N, 4] decay tensor then gives a session's token other bits beside three other
sessions than alone, which breaks "concurrency never changes results" (DESIGN.md). ``rowwise``
pads every row to a multiple of 64 values, so each row starts on a block boundary and no value is
ever left to the scalar tail: each row's result is a function of that row alone.
(Single-threaded or for tensors below ATen's 32768-element grain, as all per-token ones here are.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_ROW = 64  # a multiple of every SIMD block width ATen uses for float32 and float64


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise ``fn``, computed so that rows (last dim) are independent."""
    width = x.shape[-1]
    pad = (-width) % _ROW
    if pad == 0 and x.is_contiguous():
        return fn(x)
    rows = F.pad(x.reshape(-1, width), (0, pad))  # [R, width + pad], rows block-aligned
    return fn(rows)[:, :width].reshape(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return rowwise(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return rowwise(F.softplus, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.exp, x)
