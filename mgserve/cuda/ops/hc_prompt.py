"""The hyper-connection mix of prompt rows on the device (``HCCuda`` hands them here): GEMMs
that read each weight once for the chunk, around three passes over the streams, each one kernel:

- ``combine_mix``: the last block's output added to the streams and the streams normed in one
  pass (``NormCuda.combine_rms``, where ``prompt_combine_norm``; else hc_combine then the
  norm), the normed streams' f16 copy written beside them for the down and inject GEMMs
  (f16_rows.py, where ``linear.x16.offers``);
- the down and inject GEMMs (one GEMM where they stack: ``stack_inject``), the small silu and
  sigmoid on their outputs, the up GEMM;
- ``gate_mix``: the gated mean over the streams (hc_gate_mix), with its f16 copy for the block;
  or, with ``prompt_up_gate``, the up GEMM and the gated mean in one kernel (``up_gate_mix``).

Each kernel computes the torch ops' bits (hyper_connections.mix_with's arithmetic), so the
prompt mix keeps the bits of the reference path's sequence of ops on f16 GEMMs.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.core.reference import hyper_connections
from mgserve.core.reference import ops as ops_
from mgserve.cuda.checks import vec4_input
from mgserve.cuda.ops.hc import COMBINE_THREADS, HC_SOURCE, check_mix
from mgserve.cuda.ops.linear_stacked import matmul_stacked
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.ops.hc_cuda import HCCuda

Mixed = tuple[torch.Tensor, torch.Tensor | None]  # what the block reads [N, d], inject [N, hc]


def mix(
    ops: HCCuda, x: torch.Tensor, norm: torch.Tensor, down: QuantWeight, up: QuantWeight,
    inject: QuantWeight | None, eps: float, xn: torch.Tensor | None = None,
) -> Mixed:  # fmt: skip
    """The mix of prompt rows x [N, hc, d] (``xn``: x already normed, by ``combine_mix``)."""
    check_mix(x, norm, down, up, inject)
    matmul = ops.linear.matmul
    inj_p = None if inject is None else partial(matmul, w=inject)
    gm = partial(gate_mix, ops) if ops.prompt_gate_kernel and x.shape[2] % 4 == 0 else None
    both = None  # down and inject in one GEMM where they stack (the same bits)
    if inject is not None and ops.stack_inject:
        both = partial(matmul_stacked, ops.linear, weights=(down, inject))
    norm_f: ops_.NormFn = partial(ops.norm.rms, f16=True)  # with the f16 copy for down, inject
    if xn is not None:
        norm_f = lambda *_: xn  # noqa: E731
    fused = partial(up_gate_mix, ops, up) if gm is not None and _up_gate(ops, x) else None
    return hyper_connections.mix_with(
        x, norm, eps, partial(matmul, w=down), partial(matmul, w=up), inj_p, norm_f,
        gate_mix=gm, down_inject=both, up_gate_mix=fused,
    )  # fmt: skip


def _up_gate(ops: HCCuda, x: torch.Tensor) -> bool:
    """Whether the up GEMM and the gated mean of prompt rows x [N, hc, d] run as one kernel
    (``prompt_up_gate``): four streams, and the up GEMM on hgemm_wgmma.cu (W decoded once)."""
    lin, n = ops.linear, x.shape[0]
    return (
        ops.prompt_up_gate
        and x.shape[1] == 4
        and not (lin.cublas_prefill or lin.prefill_exact)
        and n >= lin.hgemm.tuning.min_rows
        and lin.hgemm.wgmma
        and ops.kernels.wgmma
    )


def up_gate_mix(ops: HCCuda, up: QuantWeight, low: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    """The gated mean over the streams of up(low), in one kernel (hgemm_wg_gate_mix): up decoded
    to f16 once (the bits ``linear.matmul`` multiplies) with its rows interleaved by stream, then
    multiplied by low [N, r] and mixed with xn [N, 4, d] in the GEMM's epilogue: the bits of
    ``gate_mix`` on ``linear.matmul``'s u, without writing u [N, 4 d] and reading it again."""
    lin = ops.linear
    n, hc, d = xn.shape
    rows, k = up.rows, up.k
    w16 = lin.scratch(rows * k)[: rows * k].view(rows, k)
    lin.qgemm.dequantize(up, 0, rows, w16)
    w16 = w16.view(hc, d, k).transpose(0, 1).contiguous().view(rows, k)  # row 4 c + s
    mixed = torch.empty((n, d), dtype=torch.float32, device=ops.device)
    x16 = lin.x16
    m16 = x16.room(mixed, n)
    lin.hgemm.matmul_gate_mix(x16(low), w16, vec4_input("xn", xn, ops.device), mixed, m16)
    if m16 is not None:
        x16.offer(mixed, m16)
    return mixed


def combine_mix(
    ops: HCCuda, x: torch.Tensor, out: torch.Tensor, inject_prev: torch.Tensor,
    norm: torch.Tensor, down: QuantWeight, up: QuantWeight, inject: QuantWeight | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The streams with the last block's output added, and their mix: the combine and the norm
    in one pass where ``prompt_combine_norm`` and the kernel allow (the same bits)."""
    both = None
    if ops.prompt_combine_norm and x.shape[1:] == norm.shape:
        both = ops.norm.combine_rms(x, out, inject_prev, norm, eps)
    if both is None:
        x = combine(ops, x, out, inject_prev)
        return (x, *mix(ops, x, norm, down, up, inject, eps))
    x, xn = both
    return (x, *mix(ops, x, norm, down, up, inject, eps, xn))


def gate_mix(ops: HCCuda, u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    """``hyper_connections.gated_mean`` in one kernel (hc_gate_mix): u, xn [N, hc, d] float32
    with d % 4 == 0 -> [N, d], the same bits; with its f16 copy for the block's GEMMs
    (``F16Rows.wanted``)."""
    n, hc, d = u.shape
    u, xn = (vec4_input(k, t, ops.device) for k, t in (("u", u), ("xn", xn)))
    mixed = torch.empty((n, d), dtype=torch.float32, device=ops.device)
    x16 = ops.linear.x16
    m16 = x16.room(mixed, n)
    tail = (0 if m16 is None else m16.data_ptr(),)
    _per_float4(ops, "hc_gate_mix", n * d // 4, u, xn, mixed, hc=hc, d=d, tail=tail)
    if m16 is not None:
        x16.offer(mixed, m16)
    return mixed


def combine(ops: HCCuda, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """x [N, hc, d] + inject [N, hc] x out [N, d] (hc_combine, d % 4 == 0; else torch's ops)."""
    n, hc, d = x.shape
    if d % 4 or n == 0:  # the kernel reads float4 runs of each stream
        return ops.fallback.combine(x, out, inject)
    x, out, inject = (
        vec4_input(k, t, ops.device) for k, t in (("x", x), ("out", out), ("inject", inject))
    )
    y = torch.empty_like(x)
    _per_float4(ops, "hc_combine", n * hc * d // 4, x, out, inject, y, hc=hc, d=d)
    return y


def _per_float4(
    ops: HCCuda, name: str, n4: int, *tensors: torch.Tensor, hc: int, d: int, tail: tuple = ()
) -> None:  # a thread per float4 of the output: hc_combine, hc_gate_mix
    if n4:
        ops.kernels.launch(
            ops.kernels.kernel(HC_SOURCE, name, ops.tuning.defines("BF16")),
            (n4 + COMBINE_THREADS - 1) // COMBINE_THREADS, COMBINE_THREADS,
            *(t.data_ptr() for t in tensors), np.int32(hc), np.int32(d // 4), np.int64(n4),
            *tail,
        )  # fmt: skip
