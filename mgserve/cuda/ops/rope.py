"""The rope family: rotary embedding of the first ``n_rot`` dims of each head, alone or after a
per-head RMSNorm (the q / k norms of the attention layers) in one op.

``RopeTorch`` is the reference's rotation (``ops.rope_rotate``) with the reference's angles
(``ops.rope_inv_freq``, ``ops.rope_angles``: float64, rounded to f32 once), computed per call from
the positions on their device: the reference reads a host table grown to the largest position,
which needs the positions on the host (a sync, and no CUDA graph). ``RopeCuda`` runs
``rms_norm_rope_f32`` of kernels/norm.cu (one warp per head, cos/sin in shared memory).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import ops
from mgserve.cuda.checks import check_cuda, check_f32, check_index, shape_error
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.norm import check_norm

NORM_SOURCE = "norm.cu"
ROPE_WARPS = 4  # ROPE heads per CTA of rms_norm_rope_f32: one warp per head
ROPE_MAX_DIM = 2048  # head dim bound of rms_norm_rope_f32 (shared memory: ROPE_WARPS rows of D)


def check_rope(x: torch.Tensor, pos: torch.Tensor, n_rot: int, ff: torch.Tensor | None) -> None:
    check_f32("x", x)
    if x.dim() != 3:
        raise shape_error("x", x, "[N, H, D]")
    check_index("pos", pos, x.shape[0])
    if n_rot < 2 or n_rot % 2 or n_rot > x.shape[2]:
        raise ValueError(f"n_rot must be even and in 2..{x.shape[2]} (head dim), got {n_rot}")
    if ff is not None and (ff.dim() != 1 or ff.shape[0] != n_rot // 2):
        raise shape_error("freq_factors", ff, f"[{n_rot // 2}]")


def _check_head_weight(x: torch.Tensor, w: torch.Tensor) -> None:
    check_f32("w", w)
    if w.dim() != 1:
        raise shape_error("w", w, f"[{x.shape[-1]}] (one weight for every head)")


class RopeTorch:
    """RoPE in PyTorch on the tensors' device (static shapes, sync-free)."""

    def __init__(self) -> None:
        self._inv_freq: dict[tuple[int, float, torch.device], torch.Tensor] = {}

    def inv_freq(self, n_rot: int, base: float, device: torch.device) -> torch.Tensor:
        """float64 [n_rot / 2] ``ops.rope_inv_freq``, computed on the CPU and cached per device
        (the first call copies: make it before a graph capture)."""
        key = (n_rot, float(base), device)
        t = self._inv_freq.get(key)
        if t is None:
            t = self._inv_freq[key] = ops.rope_inv_freq(n_rot, base).to(device)
            if t.is_cuda and not torch.cuda.is_current_stream_capturing():
                # the copy is done before any stream reads it: a decode step's side chain
                # (ops/branch.py) may make it while the main stream's rotation runs beside
                torch.cuda.current_stream(device).synchronize()
        return t

    def apply(
        self,
        x: torch.Tensor,  # [N, H, D] f32
        pos: torch.Tensor,  # [N] int32 (or int64) absolute positions
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,  # [n_rot / 2] divisors (llama 3), or None
    ) -> torch.Tensor:  # [N, H, D], a new tensor
        """Rotary embedding of the first ``n_rot`` dims of each head (``ops.rope``): angles
        (pos * scale) * inv_freq in float64, cos/sin rounded to f32 once; neox pairs i with
        i + n_rot/2, otherwise 2i with 2i + 1. Dims >= n_rot pass through."""
        check_rope(x, pos, n_rot, freq_factors)
        inv = self.inv_freq(n_rot, base, x.device)
        if freq_factors is not None:
            inv = inv / freq_factors.to(torch.float64)
        cos, sin = ops.rope_angles(pos, inv, scale)  # [N, n_rot / 2]
        return ops.rope_rotate(x, cos, sin, n_rot, neox)

    def norm_apply(
        self,
        x: torch.Tensor,  # [N, H, D] f32
        w: torch.Tensor,  # [D] per-head norm weight
        eps: float,
        pos: torch.Tensor,  # [N] int32
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [N, H, D]
        """apply(rms_norm(x, w, eps), pos, ...): the per-head q / k norm then rotary embedding of
        the attention layers, in one op."""
        _check_head_weight(x, w)
        check_norm(x, w)
        h = ops.rms_norm(x, w, eps)
        return self.apply(
            h, pos, n_rot=n_rot, base=base, neox=neox, scale=scale, freq_factors=freq_factors
        )


class RopeCuda:
    """RoPE (and RMSNorm + RoPE) on rms_norm_rope_f32; positions int32 on this device. The
    signatures are RopeTorch's (the family's interface): both methods forward to one launch."""

    def __init__(self, kernels: Kernels, fallback: RopeTorch) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device

    def _launch(
        self,
        x: torch.Tensor,
        w: torch.Tensor | None,
        eps: float,
        pos: torch.Tensor,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float,
        freq_factors: torch.Tensor | None,
    ) -> torch.Tensor:
        check_rope(x, pos, n_rot, freq_factors)
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, expected {self.device}")
        if x.stride(2) != 1:  # heads are read with any token / head strides, but dims in order
            x = x.contiguous()
        check_cuda("pos", pos, self.device, torch.int32)
        n, h, d = x.shape
        if d > ROPE_MAX_DIM:
            raise ValueError(f"rope.apply: head dim {d} > {ROPE_MAX_DIM}")
        if w is not None:
            check_cuda("w", w, self.device, torch.float32)
            if w.shape != (d,):
                raise shape_error("w", w, f"[{d}] (one weight for every head)")
        if freq_factors is not None:
            check_cuda("freq_factors", freq_factors, self.device, torch.float32)
        inv = self.fallback.inv_freq(n_rot, base, self.device)
        y = torch.empty((n, h, d), dtype=torch.float32, device=self.device)
        if y.numel() == 0:
            return y
        shmem = (n_rot + ROPE_WARPS * d) * 4  # cos, sin [n_rot / 2] each; one head row per warp
        self.kernels.launch(
            self.kernels.kernel(NORM_SOURCE, "rms_norm_rope_f32"),
            (n, (h + ROPE_WARPS - 1) // ROPE_WARPS),
            32 * ROPE_WARPS,
            x.data_ptr(),
            np.int64(x.stride(0)),
            np.int64(x.stride(1)),
            w.data_ptr() if w is not None else 0,
            y.data_ptr(),
            pos.data_ptr(),
            inv.data_ptr(),
            freq_factors.data_ptr() if freq_factors is not None else 0,
            np.int32(h),
            np.int32(d),
            np.int32(n_rot),
            np.int32(1 if neox else 0),
            np.float64(scale),
            np.float32(eps),
            shmem=shmem,
        )
        return y

    def apply(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._launch(x, None, 0.0, pos, n_rot, base, neox, scale, freq_factors)

    def norm_apply(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        eps: float,
        pos: torch.Tensor,
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_head_weight(x, w)
        return self._launch(x, w, eps, pos, n_rot, base, neox, scale, freq_factors)
