"""Per-slot session state on the device, one pool per kind, allocated once at start-up.

Every tensor is indexed by slot first, so a decode step of any set of sessions addresses its
state through a device tensor of slot ids: the step has one shape per batch size, whatever the
slots and positions, which is what lets it replay as a CUDA graph. Positions live on the host (the
scheduler knows them) and travel with each step.

- attention layers: K and V in the cache type (``KVLayer`` each), [n_slots, n_ctx, n_kv, head_dim]
- Gated DeltaNet layers: conv history [n_slots, K - 1, C] and recurrent state [n_slots, H_v, d, d]
- QSA layers (qwen4exp): pooled block keys [n_slots, n_ctx / r, D] and the raw keys of the
  incomplete block [n_slots, r, D]
- the PLE layer (qwen4exp): conv history [n_slots, (K - 1) * ngram, hc * d]; its token history
  (for the host-side hash) stays on the host with the runner

The layout is what the reference keeps per session (mgserve/core/state*.py), with a slot axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mgserve.core.models.kvcache import kv_storage


class PoolSize(NamedTuple):
    """The session state a device model allocates: slots (a spare padding slot included),
    positions per slot, and the K / V cache types."""

    n_slots: int
    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"


class KVLayer(NamedTuple):
    """One attention layer's K (or V) for every slot of a device pool.

    q8_0: ``values`` int8 [n_slots, n_ctx, n_kv, head_dim], ``scales`` float16
    [n_slots, n_ctx, n_kv, head_dim / 32] (x ~= values * scale per 32 values, rounded exactly as
    ``mgserve.core.models.kvcache.quantize_q8_0``). f16 / f32: ``values`` of that dtype,
    ``scales`` empty.
    Both are contiguous views of the pool's layer.
    """

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.values.dtype == torch.int8


def kv_layer(
    cache_type: str, n_slots: int, n_ctx: int, n_kv: int, head_dim: int, device: torch.device
) -> KVLayer:
    return KVLayer(*kv_storage(cache_type, (n_slots, n_ctx, n_kv, head_dim), device))


@dataclass
class SlotPools:
    """All sessions' device state. Layers are addressed by their index in the model; each dict
    holds only the layers of that kind."""

    n_slots: int
    n_ctx: int
    k: dict[int, KVLayer] = field(default_factory=dict)
    v: dict[int, KVLayer] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # [n_slots, K - 1, C]
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)  # [n_slots, H_v, d_k, d_v]
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)  # [n_slots, n_ctx / r, D]
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # [n_slots, r, D]
    ple_conv: torch.Tensor | None = None  # [n_slots, (K - 1) * ngram, hc * d]

    def add_attention(
        self, il: int, type_k: str, type_v: str, n_kv: int, head_dim: int, device: torch.device
    ) -> None:
        self.k[il] = kv_layer(type_k, self.n_slots, self.n_ctx, n_kv, head_dim, device)
        self.v[il] = kv_layer(type_v, self.n_slots, self.n_ctx, n_kv, head_dim, device)

    def add_recurrent(
        self, il: int, kernel: int, conv_dim: int, v_heads: int, head_dim: int, device: torch.device
    ) -> None:
        n = self.n_slots
        self.conv[il] = torch.zeros(n, max(kernel - 1, 0), conv_dim, device=device)
        self.ssm[il] = torch.zeros(n, v_heads, head_dim, head_dim, device=device)

    def add_qsa(self, il: int, ratio: int, dim: int, device: torch.device) -> None:
        self.blocks[il] = torch.zeros(self.n_slots, self.n_ctx // ratio, dim, device=device)
        self.pending[il] = torch.zeros(self.n_slots, ratio, dim, device=device)

    def recurrent(self, slot: int) -> list[torch.Tensor]:
        """Views of what ``slot`` holds that only goes forward: DeltaNet conv and recurrent
        states, QSA pending keys, the PLE conv history (what a checkpoint copies). K/V and block
        keys are positional: rewritten before they are read."""
        views = [t[slot] for t in (*self.conv.values(), *self.ssm.values(), *self.pending.values())]
        return views if self.ple_conv is None else [*views, self.ple_conv[slot]]

    def reset_slot(self, slot: int) -> None:
        """Start a new sequence in ``slot``: recurrent state and histories to zero."""
        for t in self.recurrent(slot):
            t.zero_()

    @property
    def recurrent_nbytes(self) -> int:
        """What one slot's ``recurrent`` state (a checkpoint) takes."""
        return sum(t.nbytes for t in self.recurrent(0))

    @property
    def nbytes(self) -> int:
        total = 0
        for kv in (*self.k.values(), *self.v.values()):
            total += kv.values.nbytes + kv.scales.nbytes
        for d in (self.conv, self.ssm, self.blocks, self.pending):
            total += sum(t.nbytes for t in d.values())
        if self.ple_conv is not None:
            total += self.ple_conv.nbytes
        return total
