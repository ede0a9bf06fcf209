"""The norm family: RMSNorm over the last dim (one weight, or one per group: hyper-connection
streams; optionally added to a residual), and the gated output norm of the DeltaNet layers
(optionally writing value heads in another order: the one ``ssm_out`` reads).

``NormTorch`` is the reference's ``ops.rms_norm`` itself; ``NormCuda`` runs kernels/norm.cu
(``rms_norm_f32``: one row per 32..256 threads, float4 loads where rows allow, the gate fused).
Both are static-shape and sync-free (CUDA-graph capturable).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import ops, rowwise
from mgserve.cuda.checks import check_cuda, check_f32, rows_view, shape_error, vec4_input, vec4_ok
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.f16_rows import F16Rows
from mgserve.cuda.ops.linear_tuning import Q8_GROUP, Q8Activations

NORM_SOURCE = "norm.cu"
_GATE_NONE, _GATE_SILU, _GATE_SIGMOID = 0, 1, 2  # gate modes of rms_norm_f32


def row_threads(d: int, vec: bool) -> int:
    """Threads per row of rms_norm_f32 for rows of d values (float4 loads when ``vec``): about
    two loads per thread, 32..256. The row's sum of squares reduces in an order set by this."""
    per_thread = d // 4 if vec else d
    tpr = 32
    while tpr < 256 and tpr * 2 <= per_thread:
        tpr *= 2
    return tpr


def check_norm(x: torch.Tensor, w: torch.Tensor) -> None:
    """x [..., D] with w [D], or x [..., G, D] with w [G, D]."""
    check_f32("x", x)
    check_f32("w", w)
    if w.dim() == 1:
        ok = x.dim() >= 1 and x.shape[-1] == w.shape[0]
    else:
        ok = w.dim() == 2 and x.dim() >= 2 and tuple(x.shape[-2:]) == tuple(w.shape)
    if not ok:
        raise ValueError(
            f"norm.rms: weight {list(w.shape)} does not match x {list(x.shape)} "
            "(expected w [D] with x [..., D], or w [G, D] with x [..., G, D])"
        )


def check_residual(residual: torch.Tensor | None, x: torch.Tensor) -> None:
    if residual is not None and (residual.shape != x.shape or residual.dtype != torch.float32):
        raise shape_error("residual", residual, f"float32 {list(x.shape)} (x's shape)")


def _check_gated(
    o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, heads: torch.Tensor | None
) -> tuple[int, int, int]:
    """(N, H_v, d_v) of a gated norm's output o [N, H_v, d_v], gate z [N, H_v * d_v], w [d_v],
    heads [H_v] int32 or None."""
    if o.dim() != 3:
        raise shape_error("o", o, "[N, H_v, d_v]")
    n, hv, dv = o.shape
    if z.shape != (n, hv * dv):
        raise shape_error("z", z, f"[{n}, {hv * dv}]")
    if w.shape != (dv,):
        raise shape_error("w", w, f"[{dv}]")
    if heads is not None and (heads.shape != (hv,) or heads.dtype != torch.int32):
        raise shape_error("heads", heads, f"int32 [{hv}]")
    return n, hv, dv


class NormTorch:
    """The norms in PyTorch on the tensors' device (the reference arithmetic)."""

    def rms(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
        *, f16: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """x / sqrt(mean(x^2) + eps) * w over the last dim; x [..., D] f32, w [D] or [G, D] (then
        x is [..., G, D] and row g of every group uses w[g]: hyper-connection streams).
        ``residual`` (x's shape): residual + that (Gemma's post-norms). ``f16``: prompt GEMMs
        read the output (NormCuda writes their f16 copy beside it; nothing to write here)."""
        check_norm(x, w)
        check_residual(residual, x)
        y = ops.rms_norm(x, w, eps)
        return y if residual is None else residual + y

    def gated(
        self,
        o: torch.Tensor,  # [N, H_v, d_v]
        z: torch.Tensor,  # [N, H_v * d_v] output gate (before its activation)
        w: torch.Tensor,  # [d_v]
        eps: float,
        sigmoid: bool,
        heads: torch.Tensor | None = None,  # [H_v] int32: where each head goes in the output
    ) -> torch.Tensor:  # [N, H_v * d_v]
        """rms_norm(o, w) * act(z) per value head, act = sigmoid (qwen4exp) or silu (qwen3next):
        ``deltanet.output`` without the out projection. With ``heads``, head j of each token is
        written as head heads[j] (a permutation: the order the out projection reads)."""
        for name, t in (("o", o), ("z", z), ("w", w)):
            check_f32(name, t)
        n, hv, dv = _check_gated(o, z, w, heads)
        act = rowwise.sigmoid if sigmoid else rowwise.silu
        y = ops.rms_norm(o, w, eps) * act(z).view(n, hv, dv)  # [N, H_v, d_v]
        if heads is not None:
            y = torch.empty_like(y).index_copy_(1, heads.long(), y)
        return y.reshape(n, hv * dv)

    def gated_xq(
        self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, sigmoid: bool,
        heads: torch.Tensor | None, *, xq: bool,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        """``gated`` (activations stay fp32 here: no int8 form)."""
        return self.gated(o, z, w, eps, sigmoid, heads), None


class NormCuda:
    """The norms on rms_norm_f32. Inputs must be float32 on this device; outputs are new
    contiguous tensors."""

    def __init__(self, kernels: Kernels, f16: F16Rows | None = None) -> None:
        self.kernels = kernels
        self.device = kernels.device
        self.f16 = f16  # where outputs that prompt GEMMs read get their f16 copy (f16_rows.py)

    def _rows(
        self,
        x: torch.Tensor,  # [rows, D] (see rows_view)
        w: torch.Tensor,  # [G, D] contiguous
        eps: float,
        z: torch.Tensor | None,  # gate (r, i) at (r // z_group) * z_stride + (r % z_group) * D + i
        z_group: int,
        gate: int,
        res: torch.Tensor | None = None,  # [rows, D] contiguous, added after the norm
        dest: torch.Tensor | None = None,  # [z_group] int32: row r written as a permuted row
        q8_tokens: int = 0,  # > 0: also y rounded to int8 as [q8_tokens, rows * D / q8_tokens]
        f16_tokens: int = 0,  # > 0: GEMMs read y (rows of f16_tokens tokens): an f16 copy
    ) -> tuple[torch.Tensor, Q8Activations | None]:  # [rows * D] flat, contiguous; int8 y
        d = w.shape[-1]
        x, n_rows, x_stride = rows_view(x, d)
        n_groups = w.numel() // d
        z_stride = 0
        if z is not None:
            z, _, z_stride = rows_view(z, z.shape[-1])
        y = torch.empty(n_rows * d, dtype=torch.float32, device=self.device)
        if n_rows == 0 or d == 0:
            return y, None
        pairs = [(x, x_stride), (w, d), (y, d)] + ([(z, z_stride)] if z is not None else [])
        pairs += [(res, d)] if res is not None else []
        vec = d % 4 == 0 and vec4_ok(*pairs)
        tpr = row_threads(d, vec)
        rpc = max(1, 256 // tpr)
        name = "rms_norm_f32_v4" if vec else "rms_norm_f32"
        xq, q8_args = None, tuple[int, ...]()
        if q8_tokens and vec and d % Q8_GROUP == 0:  # groups of 32 never straddle rows
            k = n_rows * d // q8_tokens
            xq = Q8Activations(
                torch.empty(q8_tokens, k, dtype=torch.int8, device=self.device),
                torch.empty(q8_tokens, k // Q8_GROUP, dtype=torch.float32, device=self.device),
            )
            name, q8_args = "rms_norm_q8_f32_v4", (xq.q.data_ptr(), xq.d.data_ptr())
        y16 = None
        if vec and xq is None and f16_tokens and self.f16 is not None:
            y16 = self.f16.room(y, f16_tokens)
        if y16 is not None:
            name, q8_args = "rms_norm_f16_f32_v4", (y16.data_ptr(),)
        self.kernels.launch(
            self.kernels.kernel(NORM_SOURCE, name),
            (n_rows + rpc - 1) // rpc,
            (tpr, rpc),
            x.data_ptr(),
            np.int64(x_stride),
            w.data_ptr(),
            np.int32(n_groups),
            z.data_ptr() if z is not None else 0,
            np.int32(z_group),
            np.int64(z_stride),
            res.data_ptr() if res is not None else 0,
            dest.data_ptr() if dest is not None else 0,
            y.data_ptr(),
            np.int32(n_rows),
            np.int32(d),
            np.float32(eps),
            np.int32(gate),
            *q8_args,
        )
        if y16 is not None:
            self.f16.offer(y, y16)  # type: ignore[union-attr]
        return y, xq

    def rms(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
        *, f16: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        check_norm(x, w)
        check_residual(residual, x)
        check_cuda("w", w, self.device, torch.float32)
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, expected {self.device}")
        if residual is not None:
            check_cuda("residual", residual, self.device, torch.float32)
        tokens = x.shape[0] if f16 and residual is None and x.dim() > 1 else 0
        y = self._rows(x, w, eps, None, 1, _GATE_NONE, res=residual, f16_tokens=tokens)[0]
        return y.view(x.shape)

    def combine_rms(
        self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor, w: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """A prompt mix's first pass in one kernel (rms_norm_combine_f32_v4): the streams x [N,
        G, D] combined with the last block's output out [N, D] by inject [N, G] (hc_combine's
        bits), and ``rms`` of them with w [G, D] (its bits), with the f16 copy of that for the
        GEMMs (``F16Rows.wanted``): (new streams, normed), or None where D % 4 != 0."""
        n, g, d = x.shape
        if d % 4 or w.shape != (g, d) or out.shape != (n, d) or inject.shape != (n, g):
            return None
        x, out, inject, w = (
            vec4_input(k, t, self.device) for k, t in (("x", x), ("out", out), ("inject", inject),
                                                       ("w", w))
        )  # fmt: skip
        comb, y = torch.empty_like(x), torch.empty_like(x)
        y16 = None if self.f16 is None else self.f16.room(y, n)
        tpr = row_threads(d, True)
        rpc = max(1, 256 // tpr)
        if n:
            self.kernels.launch(
                self.kernels.kernel(NORM_SOURCE, "rms_norm_combine_f32_v4"),
                (n * g + rpc - 1) // rpc, (tpr, rpc), x.data_ptr(), w.data_ptr(), np.int32(g),
                out.data_ptr(), inject.data_ptr(), comb.data_ptr(), y.data_ptr(),
                np.int32(n * g), np.int32(d), np.float32(eps), 0 if y16 is None else y16.data_ptr(),
            )  # fmt: skip
        if y16 is not None:
            self.f16.offer(y, y16)  # type: ignore[union-attr]
        return comb, y

    def gated(
        self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, sigmoid: bool,
        heads: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return self.gated_xq(o, z, w, eps, sigmoid, heads, xq=False)[0]

    def gated_xq(
        self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, sigmoid: bool,
        heads: torch.Tensor | None, *, xq: bool,
    ) -> tuple[torch.Tensor, Q8Activations | None]:  # fmt: skip
        """``gated``, and with ``xq`` its output rounded to int8 by the same kernel (what
        ``linear.quantize`` would make of it; None where d_v % 32 or rows are not float4)."""
        check_cuda("o", o, self.device, torch.float32)
        check_cuda("w", w, self.device, torch.float32)
        if z.device != self.device or z.dtype != torch.float32:
            raise ValueError(f"z must be float32 on {self.device}")
        n, hv, dv = _check_gated(o, z, w, heads)
        if heads is not None:
            check_cuda("heads", heads, self.device, torch.int32)
        gate = _GATE_SIGMOID if sigmoid else _GATE_SILU
        q8, f16 = (n, 0) if xq else (0, n)  # the out projection reads y: int8 or f16
        y, yq = self._rows(o, w, eps, z, hv, gate, dest=heads, q8_tokens=q8, f16_tokens=f16)
        return y.view(n, hv * dv), yq
