"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (q/k RMSNorm, NeoX RoPE over the
whole head) and a routed MoE FFN in every layer, no shared expert (src/models/qwen3moe.cpp)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.base import SeqInput
from mgserve.core.models.decoder import MoeLM
from mgserve.core.models.hybrid_weights import load, load_attn, load_moe
from mgserve.core.reference import gated_attention, moe, ops
from mgserve.core.reference.gated_attention import AttnWeights
from mgserve.core.reference.moe import MoeWeights


@dataclass
class Qwen3MoeLayer:
    attn_norm: torch.Tensor  # [d]
    attn: AttnWeights
    ffn_norm: torch.Tensor  # [d]
    moe: MoeWeights


class Qwen3Moe(MoeLM):
    def load_layer(self, g: GGUFFile, il: int) -> Qwen3MoeLayer:
        d = self.spec.n_embd
        return Qwen3MoeLayer(
            attn_norm=load(g, f"blk.{il}.attn_norm.weight", (d,)),
            attn=load_attn(g, il, self.spec, self.hybrid),
            ffn_norm=load(g, f"blk.{il}.ffn_norm.weight", (d,)),
            moe=load_moe(g, il, self.spec, self.hybrid),
        )

    def block(
        self, il: int, x: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:
        layer, eps, hp = self.layers[il], self.spec.rms_eps, self.hybrid
        spans = [(s.cache, s.start, s.tokens.numel()) for s in seqs]
        h = ops.rms_norm(x, layer.attn_norm, eps)
        x = x + gated_attention.attend(layer.attn, h, pos, spans, il, self.spec)
        h = ops.rms_norm(x, layer.ffn_norm, eps)
        return x + moe.moe_ffn(h, layer.moe, hp.n_expert_used, hp.norm_topk)
