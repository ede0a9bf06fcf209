"""The norm family: RMSNorm over the last dim (one weight, or one per group: hyper-connection
streams), and the gated output norm of the DeltaNet layers.

``NormTorch`` is the reference's ``ops.rms_norm`` itself; ``NormCuda`` runs kernels/norm.cu
(``rms_norm_f32``: one row per 32..256 threads, float4 loads where rows allow, the gate fused).
Both are static-shape and sync-free (CUDA-graph capturable).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import ops, rowwise
from mgserve.cuda.checks import check_cuda, check_f32, rows_view, shape_error, vec4_ok
from mgserve.cuda.launch import Kernels

NORM_SOURCE = "norm.cu"
_GATE_NONE, _GATE_SILU, _GATE_SIGMOID = 0, 1, 2  # gate modes of rms_norm_f32


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


def _check_gated(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
    """(N, H_v, d_v) of a gated norm's output o [N, H_v, d_v], gate z [N, H_v * d_v], w [d_v]."""
    if o.dim() != 3:
        raise shape_error("o", o, "[N, H_v, d_v]")
    n, hv, dv = o.shape
    if z.shape != (n, hv * dv):
        raise shape_error("z", z, f"[{n}, {hv * dv}]")
    if w.shape != (dv,):
        raise shape_error("w", w, f"[{dv}]")
    return n, hv, dv


class NormTorch:
    """The norms in PyTorch on the tensors' device (the reference arithmetic)."""

    def rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * w over the last dim; x [..., D] f32, w [D] or [G, D] (then
        x is [..., G, D] and row g of every group uses w[g]: hyper-connection streams)."""
        check_norm(x, w)
        return ops.rms_norm(x, w, eps)

    def gated(
        self,
        o: torch.Tensor,  # [N, H_v, d_v]
        z: torch.Tensor,  # [N, H_v * d_v] output gate (before its activation)
        w: torch.Tensor,  # [d_v]
        eps: float,
        sigmoid: bool,
    ) -> torch.Tensor:  # [N, H_v * d_v]
        """rms_norm(o, w) * act(z) per value head, act = sigmoid (qwen4exp) or silu (qwen3next):
        ``deltanet.output`` without the out projection."""
        for name, t in (("o", o), ("z", z), ("w", w)):
            check_f32(name, t)
        n, hv, dv = _check_gated(o, z, w)
        act = rowwise.sigmoid if sigmoid else rowwise.silu
        return (ops.rms_norm(o, w, eps) * act(z).view(n, hv, dv)).reshape(n, hv * dv)


class NormCuda:
    """The norms on rms_norm_f32. Inputs must be float32 on this device; outputs are new
    contiguous tensors."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self.device = kernels.device

    def _rows(
        self,
        x: torch.Tensor,  # [rows, D] (see rows_view)
        w: torch.Tensor,  # [G, D] contiguous
        eps: float,
        z: torch.Tensor | None,  # gate (r, i) at (r // z_group) * z_stride + (r % z_group) * D + i
        z_group: int,
        gate: int,
    ) -> torch.Tensor:  # [rows * D] flat, contiguous
        d = w.shape[-1]
        x, n_rows, x_stride = rows_view(x, d)
        n_groups = w.numel() // d
        z_stride = 0
        if z is not None:
            z, _, z_stride = rows_view(z, z.shape[-1])
        y = torch.empty(n_rows * d, dtype=torch.float32, device=self.device)
        if n_rows == 0 or d == 0:
            return y
        pairs = [(x, x_stride), (w, d), (y, d)] + ([(z, z_stride)] if z is not None else [])
        vec = d % 4 == 0 and vec4_ok(*pairs)
        per_thread = d // 4 if vec else d
        tpr = 32
        while tpr < 256 and tpr * 2 <= per_thread:  # ~2 loads per thread, 32..256 per row
            tpr *= 2
        rpc = max(1, 256 // tpr)
        name = "rms_norm_f32_v4" if vec else "rms_norm_f32"
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
            y.data_ptr(),
            np.int32(n_rows),
            np.int32(d),
            np.float32(eps),
            np.int32(gate),
        )
        return y

    def rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        check_norm(x, w)
        check_cuda("w", w, self.device, torch.float32)
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, expected {self.device}")
        return self._rows(x, w, eps, None, 1, _GATE_NONE).view(x.shape)

    def gated(
        self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, sigmoid: bool
    ) -> torch.Tensor:
        check_cuda("o", o, self.device, torch.float32)
        check_cuda("w", w, self.device, torch.float32)
        if z.device != self.device or z.dtype != torch.float32:
            raise ValueError(f"z must be float32 on {self.device}")
        n, hv, dv = _check_gated(o, z, w)
        gate = _GATE_SIGMOID if sigmoid else _GATE_SILU
        return self._rows(o, w, eps, z, hv, gate).view(n, hv * dv)
