"""``matmul_stacked``: the prompt products of one activation with several weights (the HC mix's
down and inject) in one GEMM launch.

A prompt chunk's inject projection has ``hc`` (4) output columns and the same input as the down
projection (320 columns, k = hc * d). Alone it is a GEMM of one 128-column tile row whose CTAs
(M / 128 of them) each walk the whole k; stacked under down's rows it fills the padding of
down's last column tile. Each output column of ``HGemm`` (hgemm_wgmma.cu, or hgemm.cu: the same
bits) is its own chain of k products, whatever the columns beside it, so every result is meant
to have the bits of ``LinearCuda.matmul`` on its weight alone (test_hc.py's GPU test checks it
on both kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mgserve.cuda.checks import check_weight, vec4_input
from mgserve.cuda.ops.linear import check_linear
from mgserve.cuda.ops.linear_cuda import SCRATCH_BYTES

if TYPE_CHECKING:
    from mgserve.cuda.ops.linear_cuda import LinearCuda
    from mgserve.cuda.weights import QuantWeight


def stacks(linear: LinearCuda, n: int, weights: tuple[QuantWeight, ...]) -> bool:
    """Whether ``n`` rows times ``weights`` take one launch: prompt rows on the invariant f16
    GEMM of W decoded once (``LinearCuda._prefill``'s hgemm path), weights of one k whose rows
    fit one scratch tile."""
    k, rows = weights[0].k, sum(w.rows for w in weights)
    return (
        len(weights) > 1
        and n >= linear.hgemm.tuning.min_rows
        and not linear.path.decode_kernels(n)
        and not (linear.prefill_exact or linear.cublas_prefill)
        and all(w.k == k for w in weights)
        and 2 * rows * k <= SCRATCH_BYTES
    )


def matmul_stacked(
    linear: LinearCuda, x: torch.Tensor, weights: tuple[QuantWeight, ...]
) -> tuple[torch.Tensor, ...]:
    """(x @ W^T for W in weights) (x [N, k] fp32 -> [N, W.rows] fp32 each), bitwise
    ``linear.matmul(x, W)`` each; one GEMM where ``stacks`` (the results are then column slices
    of one [N, sum of rows] tensor), else one ``matmul`` a weight."""
    if not stacks(linear, x.shape[0], weights):
        return tuple(linear.matmul(x, w) for w in weights)
    for w in weights:
        check_weight(w, linear.device)
        check_linear(x, w)
    x = vec4_input("x", x, linear.device)
    k, sizes = weights[0].k, [w.rows for w in weights]
    rows = sum(sizes)
    wt = linear.scratch(rows * k)[: rows * k].view(rows, k)  # [rows, k] f16
    for w, part in zip(weights, wt.split(sizes), strict=True):  # as LinearCuda._prefill decodes
        linear.qgemm.dequantize(w, 0, w.rows, part)  # each weight's rows, one after another
    out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=linear.device)
    linear.hgemm.matmul(linear.x16(x), wt, out)
    return out.split(sizes, dim=1)
