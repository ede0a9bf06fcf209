"""Elementwise transcendental functions and sums whose result for a row does not depend on the
other rows.

PyTorch's CPU kernels run an elementwise op over a contiguous tensor in SIMD blocks (2 vectors,
32 floats with AVX-512) and finish the tail with the scalar function; the two are different
approximations of exp/log/sigmoid, so a value's rounding depends on its position in the whole
tensor. A [N, 4] decay tensor then gives a session's token other bits beside three other
sessions than alone, which breaks "concurrency never changes results" (DESIGN.md). ``rowwise``
pads every row to a multiple of 64 values, so each row starts on a block boundary and no value is
ever left to the scalar tail: each row's result is a function of that row alone. A larger tensor
(over 32768 values, ATen's grain; GELU's over 16384) is also split over the intra-op threads at
offsets set by its size and the thread count, each part with its own scalar tail, so ``rowwise``
hands the function whole rows of at most 16384 values at a time: each call runs on one thread,
from a row's start.

Reductions have the same problem on both devices: torch's sum kernels split a row's reduction by
the tensor's shape (on the GPU, rows of a small batch are spread over more threads and blocks), so
a row's rounding depends on how many rows there are. ``sum_in_order`` and ``tree_sum`` reduce
with elementwise adds only, in an order fixed by the row's own length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_ROW = 64  # a multiple of every SIMD block width ATen uses for float32 and float64
_ONE_THREAD = 16384  # values that every elementwise op here runs on one thread (see above)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise ``fn``, computed so that rows (last dim) are independent."""
    width = x.shape[-1]
    padded = width + (-width) % _ROW
    per_call = max(1, _ONE_THREAD // max(padded, _ROW))  # rows per call (a wider row alone)
    one_call = math.prod(x.shape[:-1]) <= per_call or x.device.type != "cpu"
    if padded == width and x.is_contiguous() and one_call:
        return fn(x)
    rows = F.pad(x.reshape(-1, width), (0, padded - width))  # [R, padded], rows block-aligned
    y = fn(rows) if one_call else torch.cat([fn(part) for part in rows.split(per_call)])
    return y[:, :width].reshape(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return rowwise(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return rowwise(F.softplus, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.exp, x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return rowwise(torch.tanh, x)


def sum_in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over ``dim`` (a short one: streams, heads, a block's tokens) in index order."""
    parts = x.unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dim by halving (zero-padded to a power of two: adding an exact zero
    changes nothing), each level one elementwise add."""
    width = x.shape[-1]
    size = 1 << max(0, (width - 1).bit_length())
    if size != width:
        x = F.pad(x, (0, size - width))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
