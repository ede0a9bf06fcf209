"""qwen3next (Qwen3-Next-80B-A3B): Gated DeltaNet layers with a full-attention layer every
``full_attention_interval`` (gated, partial rotary), and a routed MoE plus a sigmoid-gated shared
expert in every layer (src/models/qwen3next.cpp).

Block: x += mixer(rms_norm(x, attn_norm)); x += moe(rms_norm(x, post_attention_norm)). The norm
gammas in the file are already 1 + w (the converter folds HF's zero-centred RMSNorm), except
``ssm_norm``, which HF stores plain.

Sessions keep a ``HybridState``. Projections and the MoE run on all sessions' tokens at once; the
DeltaNet conv and recurrence run per session for prompt chunks, and as one batch for all
sessions that decode a single token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.base import SeqInput
from mgserve.core.models.decoder import MoeLM
from mgserve.core.models.hybrid_weights import load, load_attn, load_deltanet, load_moe
from mgserve.core.models.kvcache import KVCache
from mgserve.core.models.state import HybridState
from mgserve.core.reference import deltanet, gated_attention, moe, ops
from mgserve.core.reference.deltanet import DeltaNetWeights
from mgserve.core.reference.gated_attention import AttnWeights
from mgserve.core.reference.moe import MoeWeights

DELTA_CHUNK = 64  # tokens per step of the chunked delta rule (results do not depend on it)


@dataclass
class Qwen3NextLayer:
    attn_norm: torch.Tensor  # [d]
    mixer: DeltaNetWeights | AttnWeights
    post_attention_norm: torch.Tensor  # [d]
    moe: MoeWeights


def _state(s: SeqInput) -> HybridState:
    if not isinstance(s.cache, HybridState):
        raise ValueError("qwen3next sessions need the HybridState from new_cache()")
    return s.cache


class Qwen3Next(MoeLM):
    rewindable = False  # DeltaNet and conv state only go forward (see scheduler.py)

    def load_layer(self, g: GGUFFile, il: int) -> Qwen3NextLayer:
        d, spec, hp = self.spec.n_embd, self.spec, self.hybrid
        mixer: DeltaNetWeights | AttnWeights = (
            load_deltanet(g, il, spec, hp) if hp.recurrent[il] else load_attn(g, il, spec, hp)
        )
        return Qwen3NextLayer(
            attn_norm=load(g, f"blk.{il}.attn_norm.weight", (d,)),
            mixer=mixer,
            post_attention_norm=load(g, f"blk.{il}.post_attention_norm.weight", (d,)),
            moe=load_moe(g, il, spec, hp),
        )

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache:
        # The runner only passes the object back in SeqInput.cache; see the report on base.py.
        return cast(KVCache, HybridState(self.spec, self.hybrid, n_ctx, type_k, type_v))

    def begin(self, seqs: Sequence[SeqInput]) -> None:
        states = [_state(s) for s in seqs]
        if len({id(st) for st in states}) != len(states):
            raise ValueError("a session appears twice in one forward call")
        for i, (s, st) in enumerate(zip(seqs, states, strict=True)):
            if s.start == 0:  # a new sequence in this slot
                st.reset()
            if s.start != st.pos:
                raise ValueError(
                    f"sequence {i}: starts at {s.start} but its recurrent state is at position "
                    f"{st.pos}; restore a snapshot to go back"
                )

    def end(self, seqs: Sequence[SeqInput]) -> None:
        for s in seqs:
            _state(s).pos = s.start + s.tokens.numel()

    def block(
        self, il: int, x: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:
        layer, eps, hp = self.layers[il], self.spec.rms_eps, self.hybrid
        h = ops.rms_norm(x, layer.attn_norm, eps)
        if isinstance(layer.mixer, DeltaNetWeights):
            x = x + self.linear_attention(il, layer.mixer, h, seqs)
        else:
            states = [_state(s) for s in seqs]
            spans = [(st.kv, s.start, s.tokens.numel()) for s, st in zip(seqs, states, strict=True)]
            kv_layer = states[0].kv_index[il]
            x = x + gated_attention.attend(layer.mixer, h, pos, spans, kv_layer, self.spec)
        h = ops.rms_norm(x, layer.post_attention_norm, eps)
        return x + moe.moe_ffn(h, layer.moe, hp.n_expert_used, hp.norm_topk)

    def linear_attention(
        self, il: int, w: DeltaNetWeights, h: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:  # [N, d]
        hp, eps = self.hybrid, self.spec.rms_eps
        qkv, z, g, beta = deltanet.project(h, w, hp)  # token-wise, all sessions
        o = torch.empty(h.shape[0], hp.ssm_v_heads, hp.ssm_head_dim)  # [N, H_v, d_v]
        offsets = torch.tensor([0] + [s.tokens.numel() for s in seqs]).cumsum(0).tolist()
        r = _state(seqs[0]).rec_index[il]
        decode = [i for i, s in enumerate(seqs) if s.tokens.numel() == 1]
        groups = [decode] if decode else []  # all single-token sessions share one recurrent step
        groups += [[i] for i, s in enumerate(seqs) if s.tokens.numel() > 1]
        for group in groups:
            rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in group])
            t = offsets[group[0] + 1] - offsets[group[0]]
            states = [_state(seqs[i]) for i in group]
            out, conv, ssm = deltanet.mix(
                qkv[rows].view(len(group), t, -1),
                g[rows].view(len(group), t, -1),
                beta[rows].view(len(group), t, -1),
                torch.stack([st.conv[r] for st in states]),
                torch.stack([st.ssm[r] for st in states]),
                w,
                hp,
                eps,
                DELTA_CHUNK,
            )
            o[rows] = out.reshape(len(group) * t, hp.ssm_v_heads, hp.ssm_head_dim)
            for j, st in enumerate(states):
                st.conv[r] = conv[j]
                st.ssm[r] = ssm[j]
        return deltanet.output(o, z, w, eps)
