"""``AttentionCuda``: the attention family on ``kernels/attention.cu``.

Decode is flash-decoding with tensor cores: one CTA per (chunk of positions, KV head, session)
holding all query heads of the group, so K/V are read once; a combine kernel merges the chunks in
a fixed order, so results never depend on the batch. The same kernel runs QSA attention over
selected blocks (``run_decode`` with ``sel``; ops/qsa_cuda.py). Prefill runs flash attention
on tensor cores (ops/attention_prefill.py: f16 operands, about 1e-3 relative, every chunk length
alike, so a query's bits never depend on how its prompt was chunked); with ``flash_prefill``
off, the decode kernel once per query instead ("virtual sessions": a decode step's fp32-grade
numerics, slower; ``run_virtual``). Pools, head dims or groups the kernels do not cover (bf16 /
f32 pools, head_dim not in HEAD_DIMS, > 16 query heads per KV head) go to the torch version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.checks import as_i32, check_index, on_device
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.attention import AttentionTorch, check_q
from mgserve.cuda.ops.attention_prefill import FlashPrefill, cdiv, kv_defines
from mgserve.cuda.ops.kv import check_kv, check_span
from mgserve.cuda.pools import KVLayer

if TYPE_CHECKING:
    from cuda.core import Kernel

ATTN_SOURCE = "attention.cu"
ATT_THREADS = 128  # ATT_THREADS in attention.cu: 4 warps
ATT_WARPS = 4
ATT_TILE = 16 * ATT_WARPS  # positions per pipeline stage
ATT_STAGES = 2  # ATT_STAGES in attention.cu (default)
MAX_SPLITS = 128  # ATT_MAX_SPLITS in attention.cu: chunks per session at most
COMBINE_THREADS = 128
MAX_GROUP = 16  # query heads per KV head the kernel holds (one m16 tensor-core tile)
HEAD_DIMS = (64, 128, 256)  # head dims attention.cu is instantiated for
DENSE_MIN_CHUNK = 256  # positions per CTA at least, dense / windowed decode
_PREFILL_PART_ELEMS = 1 << 26  # bound on the [T, H, splits, D] fp32 partials of one run_virtual


def decode_smem_bytes(head_dim: int, k_q8: bool, v_q8: bool) -> int:
    """Dynamic shared memory of attn_decode (SMEM_B in attention.cu, same formula): Q fragments,
    then ATT_STAGES stages of padded K/V rows (+ q8 scales), overlaid by the final warp merge."""

    def pad(row_w: int, targets: tuple[int, ...], m: int) -> int:
        return min((t - row_w) % m for t in targets)

    k_row_w = head_dim * (1 if k_q8 else 2) // 4
    v_row_w = head_dim * (1 if v_q8 else 2) // 4
    k_row = (k_row_w + (pad(k_row_w, (8, 24), 32) if k_q8 else pad(k_row_w, (16,), 32))) * 4
    v_row = (v_row_w + pad(v_row_w, (4, 12), 16)) * 4
    sc_row = head_dim // 32 * 2
    stage = ATT_TILE * (k_row + v_row) + ATT_TILE * sc_row * (int(k_q8) + int(v_q8))
    q_frag = head_dim // 16 * 2 * 32 * 16
    merge = ATT_WARPS * 16 * head_dim * 4
    return q_frag + max(ATT_STAGES * stage, merge)


def decode_defines(head_dim: int, k_q8: bool, v_q8: bool) -> tuple[tuple[str, str], ...]:
    """The -D values of attention.cu (attn_decode, attn_combine) for these pools."""
    return kv_defines(head_dim, k_q8, v_q8, decode_smem_bytes(head_dim, k_q8, v_q8))


class AttentionCuda:
    """The attention ops on attention.cu (see the module docstring). ``decode`` and ``prefill``
    repeat AttentionTorch's signatures and argument checks on purpose: the twins are
    interchangeable op by op, and each checks its inputs before choosing kernel or fallback."""

    def __init__(self, kernels: Kernels, fallback: AttentionTorch) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device
        self.flash = FlashPrefill(kernels)
        self.flash_prefill = True  # prefill on attn_prefill (False: the decode kernel per query)

    def covers(self, q: torch.Tensor, k: KVLayer, v: KVLayer) -> bool:
        """Whether attn_decode covers these pools and heads."""
        kinds = (torch.int8, torch.float16)
        d, n_kv = k.values.shape[3], k.values.shape[2]
        return (
            k.values.dtype in kinds
            and v.values.dtype in kinds
            and d in HEAD_DIMS
            and q.shape[1] // n_kv <= MAX_GROUP
            and on_device(self.device, q, k.values, v.values)
            and all(t.is_contiguous() for t in (k.values, k.scales, v.values, v.scales))
        )

    def _decode_kernels(self, d: int, k_q8: bool, v_q8: bool) -> tuple[Kernel, Kernel, int]:
        smem = decode_smem_bytes(d, k_q8, v_q8)
        defines = decode_defines(d, k_q8, v_q8)
        kern = self.kernels.kernel(ATTN_SOURCE, "attn_decode", defines, smem=smem)
        return kern, self.kernels.kernel(ATTN_SOURCE, "attn_combine", defines), smem

    def run_decode(
        self,
        q: torch.Tensor,  # [B, H, D] contiguous float32
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,  # [B] int32
        lengths: torch.Tensor,  # [B] int32
        sel: torch.Tensor | None,  # [B, top] int32 selected blocks (QSA) or None (dense)
        *,
        scale: float,
        bound: int,  # most visible (virtual) positions of any session: sizes the grid
        softcap: float = 0.0,
        window: int = 0,
        min_chunk: int = DENSE_MIN_CHUNK,
        top: int = 0,  # QSA: blocks selected per query
        ratio: int = 1,  # QSA: positions per block
    ) -> torch.Tensor:  # [B, H * D]
        """attn_decode + attn_combine on checked, kernel-ready arguments (``covers``)."""
        b, h, d = q.shape
        n_ctx, n_kv = k.values.shape[1], k.values.shape[2]
        out = torch.empty((b, h * d), dtype=torch.float32, device=self.device)
        if b == 0:
            return out
        n_splits = max(1, min(MAX_SPLITS, cdiv(bound, min_chunk)))
        part_o = torch.empty((b, h, n_splits, d), dtype=torch.float32, device=self.device)
        part_ml = torch.empty((b, h, n_splits, 2), dtype=torch.float32, device=self.device)
        kern, comb, smem = self._decode_kernels(d, k.quantized, v.quantized)
        qsa = sel is not None
        self.kernels.launch(
            kern,
            (n_splits, n_kv, b),
            ATT_THREADS,
            q.data_ptr(),
            k.values.data_ptr(),
            k.scales.data_ptr() if k.quantized else 0,
            v.values.data_ptr(),
            v.scales.data_ptr() if v.quantized else 0,
            slots.data_ptr(),
            lengths.data_ptr(),
            sel.data_ptr() if sel is not None else 0,
            part_o.data_ptr(),
            part_ml.data_ptr(),
            np.int32(n_ctx),
            np.int32(n_kv),
            np.int32(h // n_kv),
            np.float32(scale),
            np.float32(softcap),
            np.int32(window),
            np.int32(min_chunk),
            np.int32(top),
            np.int32(ratio),
            shmem=smem,
        )
        self.kernels.launch(
            comb,
            (h, b),
            COMBINE_THREADS,
            part_o.data_ptr(),
            part_ml.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            np.int32(n_ctx),
            np.int32(h),
            np.int32(n_splits),
            np.int32(window),
            np.int32(min_chunk),
            np.int32(1 if qsa else 0),
            np.int32(top),
            np.int32(ratio),
        )
        return out

    def decode(
        self,
        q: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        b, _ = check_q(q, n_kv, d, "B")
        if not self.covers(q, k, v):
            return self.fallback.decode(
                q, k, v, slots, lengths, scale=scale, window=window, softcap=softcap
            )
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        slots = as_i32("slots", slots, self.device)
        lengths = as_i32("lengths", lengths, self.device)
        bound = min(n_ctx, window) if window > 0 else n_ctx
        return self.run_decode(
            q.contiguous(), k, v, slots, lengths, None, scale=scale, bound=bound, softcap=softcap,
            window=window,
        )  # fmt: skip

    def run_virtual(
        self,
        q: torch.Tensor,  # [T, H, D] contiguous float32
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        sel: torch.Tensor | None,  # [T, top] int32 (QSA) or None (dense causal / window)
        *,
        scale: float,
        bound: int,
        softcap: float = 0.0,
        window: int = 0,
        min_chunk: int = DENSE_MIN_CHUNK,
        top: int = 0,
        ratio: int = 1,
    ) -> torch.Tensor:  # [T, H * D]
        """The decode kernel over every query of one session's chunk (query j a virtual session
        at position start + j), in as few launches as _PREFILL_PART_ELEMS allows."""
        t, h, d = q.shape
        slots = torch.full((t,), slot, dtype=torch.int32, device=self.device)
        lengths = torch.arange(start + 1, start + t + 1, dtype=torch.int32, device=self.device)
        n_splits = max(1, min(MAX_SPLITS, cdiv(bound, min_chunk)))
        group = max(1, _PREFILL_PART_ELEMS // (h * n_splits * d))
        outs = []
        for c0 in range(0, max(t, 1), group):
            c1 = min(t, c0 + group)
            outs.append(self.run_decode(
                q[c0:c1], k, v, slots[c0:c1], lengths[c0:c1],
                None if sel is None else sel[c0:c1], scale=scale, bound=bound, softcap=softcap,
                window=window, min_chunk=min_chunk, top=top, ratio=ratio,
            ))  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def prefill(
        self,
        q: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        t, h = check_q(q, n_kv, d, "T")
        check_span(n_ctx, n_slots, slot, start, t)
        if not self.covers(q, k, v):
            return self.fallback.prefill(
                q, k, v, slot, start, scale=scale, window=window, softcap=softcap
            )
        qc = q.contiguous()
        if self.flash_prefill:
            return self.flash.run(
                qc, k, v, slot, start, scale=scale, window=window, softcap=softcap
            )
        end = start + t
        return self.run_virtual(
            qc, k, v, slot, start, None, scale=scale, bound=min(end, window) if window > 0 else end,
            softcap=softcap, window=window,
        )  # fmt: skip
