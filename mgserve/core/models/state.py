"""Per-session state of a hybrid model (qwen3next): K/V of the full-attention layers, and for each
Gated DeltaNet layer its recurrent state and conv history.

Unlike a KV cache, the recurrent part cannot be rewound by writing at an earlier position: it is
the state after exactly ``pos`` tokens. Rolling back (rejected drafts, prefix reuse) therefore
goes through ``snapshot()`` / ``restore()``: a snapshot copies the recurrent and conv states
(small: independent of context length) and remembers ``pos``; the K/V rows past a restored
``pos`` are stale but are always rewritten before they are read.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.models.kvcache import KVCache


def kv_spec(spec: ModelSpec, hp: HybridSpec) -> ModelSpec:
    """``spec`` cut down to the layers that keep K/V (for kvcache.kv_bytes_per_token)."""
    return dataclasses.replace(spec, n_layer=len(hp.attn_layers), swa_layers=())


class Snapshot(NamedTuple):
    pos: int  # tokens consumed when taken
    conv: torch.Tensor  # [n_recurrent, K - 1, conv_dim]
    ssm: torch.Tensor  # [n_recurrent, H_v, d_k, d_v]


class HybridState:
    """The state of one slot. ``forward`` must continue at ``pos`` (or restore a snapshot first)."""

    def __init__(
        self, spec: ModelSpec, hp: HybridSpec, n_ctx: int, type_k: str, type_v: str
    ) -> None:
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        self.n_ctx = n_ctx
        self.pos = 0  # tokens consumed so far: the position the next forward must start at
        attn, rec = hp.attn_layers, hp.recurrent_layers
        # K/V only for the attention layers: layer il lives at index kv_index[il] of this cache.
        self.kv = KVCache(kv_spec(spec, hp), n_ctx, type_k, type_v)
        self.kv_index = {il: i for i, il in enumerate(attn)}
        self.rec_index = {il: i for i, il in enumerate(rec)}
        d = hp.ssm_head_dim
        self.conv = torch.zeros(len(rec), max(hp.ssm_conv - 1, 0), hp.conv_dim)  # [R, K-1, C]
        self.ssm = torch.zeros(len(rec), hp.ssm_v_heads, d, d)  # [R, H_v, d_k, d_v]

    def snapshot(self) -> Snapshot:
        return Snapshot(self.pos, self.conv.clone(), self.ssm.clone())

    def restore(self, snap: Snapshot) -> None:
        """Go back to (or forward to) the state ``snap`` recorded; K/V up to snap.pos are kept."""
        if snap.conv.shape != self.conv.shape or snap.ssm.shape != self.ssm.shape:
            raise ValueError("snapshot does not belong to a state of this model")
        if snap.pos > self.n_ctx:
            raise ValueError(f"snapshot position {snap.pos} exceeds the context of {self.n_ctx}")
        self.conv.copy_(snap.conv)
        self.ssm.copy_(snap.ssm)
        self.pos = snap.pos

    def copy(self) -> HybridState:
        """An independent copy (K/V included), e.g. to fork a session."""
        return copy.deepcopy(self)

    def reset(self) -> None:
        self.conv.zero_()
        self.ssm.zero_()
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.conv.nbytes + self.ssm.nbytes

    @property
    def recurrent_nbytes(self) -> int:
        """What a snapshot costs."""
        return self.conv.nbytes + self.ssm.nbytes
