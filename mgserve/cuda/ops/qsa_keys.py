"""QSA block keys (qwen4exp): a block's key is the mean of its ``ratio`` raw indexer keys, then
RMSNorm, then RoPE at the block's first position (``mgserve.core.reference.qsa.pool_blocks``).

Sessions keep the raw keys of their incomplete block (``pending`` [n_slots, ratio, D]) and the
pooled keys of complete ones (``blocks`` [n_slots, n_ctx / ratio, D]); each step pools the blocks
its tokens complete. No kernel of its own: the pooling runs on the backend's norm and rope
families, so one class serves both backends. Decode is static-shape and sync-free (every row
pools its slot's pending block and keeps the result only where the block is complete).
"""

from __future__ import annotations

import torch

from mgserve.core.reference import rowwise
from mgserve.cuda.ops.norm import NormCuda, NormTorch
from mgserve.cuda.ops.rope import RopeCuda, RopeTorch


class BlockKeys:
    """Pooling of QSA block keys on the backend's norm and rope families. ``write_decode``
    (decode: one token per session) and ``write_span`` (prefill: one session's chunk) take the
    same pooling arguments, passed through to ``pool``."""

    def __init__(self, norm: NormTorch | NormCuda, rope: RopeTorch | RopeCuda) -> None:
        self.norm, self.rope = norm, rope

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
    ) -> None:
        """Add one token per session to its pending block; pool the blocks this completes."""
        r = pending.shape[1]
        slots_l, pos_l = slots.long(), pos.long()
        pending[slots_l, pos_l % r] = raw
        first = (pos_l + 1 - r).clamp_min(0)  # the block's first position, once complete
        pooled = self.pool(
            pending.index_select(0, slots_l), first, k_norm, eps, n_rot=n_rot, base=base,
            scale=scale,
        )  # fmt: skip
        done = ((pos_l + 1) % r == 0)[:, None]
        b = pos_l // r
        blocks[slots_l, b] = torch.where(done, pooled, blocks[slots_l, b])

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
