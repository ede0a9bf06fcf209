"""QSA block keys (qwen4exp): a block's key is the mean of its ``ratio`` raw indexer keys, then
RMSNorm, then RoPE at the block's first position (``mgserve.core.reference.qsa.pool_blocks``).

Sessions keep the raw keys of their incomplete block (``pending`` [n_slots, ratio, D]) and the
pooled keys of complete ones (``blocks`` [n_slots, n_ctx / ratio, D]); each step pools the blocks
its tokens complete. The pooling runs on the backend's norm and rope families, so one class
serves both backends; given ``kernels`` (the CUDA backend with ``fused_decode``), a decode step
instead runs ``qsa_keys_decode_f32`` (kernels/norm.cu): the same arithmetic (the norm and rope
kernels' device code, the sum in order, torch's reciprocal for the mean) in one launch instead of
about twenty. Decode is static-shape and sync-free (every row pools its slot's pending block and
keeps the result only where the block is complete). With ``chains`` (ops/chains.py) the rows of
a run (one slot's consecutive positions) go in order: each pools its block as it stands after
it, and the slot keeps the pending block after the run's last row (the kernel loops over the run;
the torch version gathers each row's block, ``chains.pending_after``, and every row of a run
writes the same values: the block's key where the run completes it, the pending block after it).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import rowwise
from mgserve.cuda.checks import check_cuda, vec4_ok
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.chains import Chains, pending_after
from mgserve.cuda.ops.norm import NORM_SOURCE, NormCuda, NormTorch, row_threads
from mgserve.cuda.ops.rope import RopeCuda, RopeTorch


class BlockKeys:
    """Pooling of QSA block keys on the backend's norm and rope families. ``write_decode``
    (decode: one token per session) and ``write_span`` (prefill: one session's chunk) take the
    same pooling arguments, passed through to ``pool``."""

    def __init__(
        self, norm: NormTorch | NormCuda, rope: RopeTorch | RopeCuda, kernels: Kernels | None = None
    ) -> None:
        self.norm, self.rope, self.kernels = norm, rope, kernels

    def pool(
        self,
        raw: torch.Tensor,  # [B, ratio, D] raw keys of whole blocks
        starts: torch.Tensor,  # [B] each block's first position
        k_norm: torch.Tensor,  # [D]
        eps: float,
        *,
        n_rot: int,
        base: float,
        scale: float,
    ) -> torch.Tensor:  # [B, D]
        """Mean, RMSNorm, NeoX RoPE at each block's first position."""
        pooled = self.norm.rms(rowwise.sum_in_order(raw, 1) / raw.shape[1], k_norm, eps)
        rotated = self.rope.apply(
            pooled[:, None].contiguous(), starts.to(torch.int32), n_rot=n_rot, base=base,
            neox=True, scale=scale,
        )  # fmt: skip
        return rotated[:, 0]

    def write_decode(
        self,
        raw: torch.Tensor,  # [B, D] the step's raw keys
        pending: torch.Tensor,  # [n_slots, ratio, D]
        blocks: torch.Tensor,  # [n_slots, n_ctx / ratio, D]
        slots: torch.Tensor,  # [B] int32
        pos: torch.Tensor,  # [B] int32 each token's position
        k_norm: torch.Tensor,
        eps: float,
        *,
        n_rot: int,
        base: float,
        scale: float,
        chains: Chains | None = None,
    ) -> None:
        """Add one token per session to its pending block; pool the blocks this completes."""
        if self.kernels is not None and isinstance(self.rope, RopeCuda):
            self._decode_kernel(
                raw, pending, blocks, slots, pos, k_norm, eps, n_rot=n_rot, base=base,
                scale=scale, chains=chains,
            )  # fmt: skip
            return
        r = pending.shape[1]
        slots_l, pos_l = slots.long(), pos.long()
        if chains is None or chains.alone:
            pending[slots_l, pos_l % r] = raw
            after = pending.index_select(0, slots_l)
        else:
            after = pending_after(pending, raw, slots, pos, chains)
        first = (pos_l + 1 - r).clamp_min(0)  # the block's first position, once complete
        pooled = self.pool(after, first, k_norm, eps, n_rot=n_rot, base=base, scale=scale)
        b = pos_l // r
        if chains is None or chains.alone:
            done = ((pos_l + 1) % r == 0)[:, None]
            blocks[slots_l, b] = torch.where(done, pooled, blocks[slots_l, b])
            return
        # the row of the run that completes this row's block, if the run reaches it
        end = torch.arange(raw.shape[0], device=raw.device) + (r - 1 - pos_l % r)
        done = (end <= chains.last.long())[:, None]
        got = pooled.index_select(0, torch.minimum(end, chains.last.long()))
        blocks[slots_l, b] = torch.where(done, got, blocks[slots_l, b])
        pending.index_copy_(0, slots_l, chains.select(after))

    def _decode_kernel(
        self, raw: torch.Tensor, pending: torch.Tensor, blocks: torch.Tensor,
        slots: torch.Tensor, pos: torch.Tensor, k_norm: torch.Tensor, eps: float, *,
        n_rot: int, base: float, scale: float, chains: Chains | None,
    ) -> None:  # fmt: skip
        """``write_decode`` in one launch of qsa_keys_decode_f32 (same bits)."""
        assert self.kernels is not None and isinstance(self.rope, RopeCuda)
        dev = self.kernels.device
        n, dim = raw.shape
        r = pending.shape[1]
        if tuple(pending.shape[2:]) != (dim,) or blocks.shape[2] != dim:
            raise ValueError(f"qsa_keys: raw [{n}, {dim}] does not match the pools' key width")
        if n_rot < 2 or n_rot % 2 or n_rot > dim:
            raise ValueError(f"n_rot must be even and in 2..{dim}, got {n_rot}")
        raw = raw.contiguous()
        f32 = (("raw", raw), ("pending", pending), ("blocks", blocks), ("k_norm", k_norm))
        for name, t in f32:
            check_cuda(name, t, dev, torch.float32)
        for name, t in (("slots", slots), ("pos", pos)):
            check_cuda(name, t, dev, torch.int32)
            if tuple(t.shape) != (n,):
                raise ValueError(f"qsa_keys: {name} must be [{n}], one per raw key, got {t.shape}")
        if chains is not None:
            check_cuda("runs", chains.runs, dev, torch.int32)
            if tuple(chains.runs.shape) != (n,):
                raise ValueError(f"qsa_keys: runs must be [{n}], got {chains.runs.shape}")
        if n == 0:
            return
        pooled = torch.empty(n, dim, dtype=torch.float32, device=dev)
        normed = torch.empty_like(pooled)
        vec = dim % 4 == 0 and vec4_ok((pooled, dim), (k_norm, dim), (normed, dim))
        self.kernels.launch(
            self.kernels.kernel(NORM_SOURCE, "qsa_keys_decode_f32"),
            n,
            row_threads(dim, vec),
            raw.data_ptr(), pending.data_ptr(), blocks.data_ptr(), slots.data_ptr(),
            pos.data_ptr(), k_norm.data_ptr(),
            self.rope.fallback.inv_freq(n_rot, base, dev).data_ptr(),
            pooled.data_ptr(), normed.data_ptr(), np.int32(n), np.int32(r),
            np.int32(blocks.shape[1]), np.int32(dim), np.int32(n_rot), np.float64(scale),
            np.float32(eps), np.float32(1) / np.float32(r), np.int32(vec),
            0 if chains is None else chains.runs.data_ptr(),
            shmem=n_rot * 4,
        )  # fmt: skip

    def write_span(
        self,
        raw: torch.Tensor,  # [T, D] raw keys of one session's chunk
        pending: torch.Tensor,
        blocks: torch.Tensor,
        slot: int,
        start: int,  # position of the chunk's first token
        k_norm: torch.Tensor,
        eps: float,
        *,
        n_rot: int,
        base: float,
        scale: float,
    ) -> None:
        """Pool every block the chunk completes; keep the rest pending."""
        r, dim = pending.shape[1], pending.shape[2]
        buf = torch.cat((pending[slot, : start % r], raw))
        first_block, n_new = start // r, buf.shape[0] // r
        if n_new:
            starts = (first_block + torch.arange(n_new, device=raw.device)) * r
            whole = buf[: n_new * r].view(n_new, r, dim)
            blocks[slot, first_block : first_block + n_new] = self.pool(
                whole, starts, k_norm, eps, n_rot=n_rot, base=base, scale=scale
            )
        rest = buf[n_new * r :]
        pending[slot, : rest.shape[0]] = rest
