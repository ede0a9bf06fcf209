"""llama / qwen2 / qwen3 on the reference ops: pre-norm blocks, GQA attention, SwiGLU MLP.

The three differ only in switches on ``ModelSpec``: qwen2 adds q/k/v biases, qwen3 RMS-normalizes q
and k per head, and llama rotates consecutive pairs (see gguf/hparams.py). ``Gemma3`` (gemma3.py)
reuses everything here but the block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import dense_moe
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.base import SeqInput
from mgserve.core.models.decoder import DecoderLM
from mgserve.core.models.hybrid_weights import load_moe
from mgserve.core.models.tensors import load, load_qkv, optional
from mgserve.core.reference import moe, ops, rowwise
from mgserve.core.reference.moe import MoeWeights


@dataclass
class Layer:  # weights are [out, in] float32 (torch order of GGUF's [in, out])
    attn_norm: torch.Tensor  # [n_embd]
    wq: torch.Tensor  # [n_head * head_dim, n_embd]
    wk: torch.Tensor  # [n_head_kv * head_dim, n_embd]
    wv: torch.Tensor  # [n_head_kv * head_dim, n_embd]
    wo: torch.Tensor  # [n_embd, n_head * head_dim]
    ffn_norm: torch.Tensor  # [n_embd]
    gate: torch.Tensor | None  # [n_ff, n_embd]; None in a layer of experts
    up: torch.Tensor | None  # [n_ff, n_embd]
    down: torch.Tensor | None  # [n_embd, n_ff]
    bq: torch.Tensor | None = None  # [n_head * head_dim] (qwen2; optional on every arch)
    bk: torch.Tensor | None = None  # [n_head_kv * head_dim]
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim] (qwen3, gemma3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [n_embd] (gemma3)
    post_ffn_norm: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # [n_embd] optional biases (llama.cpp: TENSOR_NOT_REQUIRED)
    gate_b: torch.Tensor | None = None  # [n_ff]
    up_b: torch.Tensor | None = None  # [n_ff]
    down_b: torch.Tensor | None = None  # [n_embd]
    moe: MoeWeights | None = None  # llama with experts (Mixtral-style files)


def load_layer(g: GGUFFile, spec: ModelSpec, il: int) -> Layer:
    """Layer ``il`` in any form llama.cpp loads: q/k/v fused or split, biases where present."""
    d, q, kv, ff, p = spec.n_embd, spec.q_dim, spec.kv_dim, spec.n_ff, f"blk.{il}."

    def w(name: str, *shape: int) -> torch.Tensor:
        return load(g, p + name, shape)

    def opt(name: str, *shape: int) -> torch.Tensor | None:
        return optional(g, p + name, shape)

    qkv = load_qkv(g, p, d, q, kv, kv)
    experts = dense_moe(spec)
    dense = experts is None
    layer = Layer(
        attn_norm=w("attn_norm.weight", d),
        wq=qkv.wq,
        wk=qkv.wk,
        wv=qkv.wv,
        wo=w("attn_output.weight", q, d),
        ffn_norm=w("ffn_norm.weight", d),
        gate=w("ffn_gate.weight", d, ff) if dense else None,
        up=w("ffn_up.weight", d, ff) if dense else None,
        down=w("ffn_down.weight", ff, d) if dense else None,
        moe=None if experts is None else load_moe(g, il, spec, experts),
        bq=qkv.bq,
        bk=qkv.bk,
        bv=qkv.bv,
        bo=opt("attn_output.bias", d),
        gate_b=opt("ffn_gate.bias", ff),
        up_b=opt("ffn_up.bias", ff),
        down_b=opt("ffn_down.bias", d),
    )
    if spec.qk_norm:
        layer.q_norm = w("attn_q_norm.weight", spec.head_dim)
        layer.k_norm = w("attn_k_norm.weight", spec.head_dim)
    if spec.gemma:
        layer.post_attn_norm = w("post_attention_norm.weight", d)
        layer.post_ffn_norm = w("post_ffw_norm.weight", d)
    return layer


class Llama(DecoderLM):
    """A dense decoder: pre-norm blocks of attention and a SwiGLU MLP (or experts)."""

    def load_head(self, g: GGUFFile) -> None:
        spec = self.spec
        super().load_head(g)
        self.output_b = optional(g, "output.bias", (spec.n_vocab,))  # [n_vocab] (qwen2)
        self.rope_freqs: torch.Tensor | None = None  # llama 3.1 style per-frequency divisors
        if "rope_freqs.weight" in g.tensors:
            self.rope_freqs = load(g, "rope_freqs.weight", (spec.n_rot // 2,))

    def load_layer(self, g: GGUFFile, il: int) -> Layer:
        return load_layer(g, self.spec, il)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        h = ops.rms_norm(x, self.output_norm, spec.rms_eps)  # [R, d]
        logits = ops.linear(h, self.output, self.output_b)  # [R, n_vocab]
        if spec.final_softcap > 0.0:
            logits = rowwise.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

    def block(
        self, il: int, x: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:
        layer: Layer = self.layers[il]
        eps = self.spec.rms_eps
        x = x + self.attend(il, layer, ops.rms_norm(x, layer.attn_norm, eps), pos, seqs)
        h = ops.rms_norm(x, layer.ffn_norm, eps)
        if layer.moe is not None:
            return x + moe.moe_ffn(h, layer.moe, self.spec.n_expert_used, True)
        assert layer.gate is not None and layer.up is not None and layer.down is not None
        m = ops.swiglu(ops.linear(h, layer.gate, layer.gate_b), ops.linear(h, layer.up, layer.up_b))
        return x + ops.linear(m, layer.down, layer.down_b)

    def attend(
        self, il: int, layer: Layer, h: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:  # [N, n_embd]
        """Self-attention of all sequences' tokens, each against its own cache."""
        spec = self.spec
        n = h.shape[0]
        q = ops.linear(h, layer.wq, layer.bq).view(n, spec.n_head, spec.head_dim)  # [N, H, Dh]
        k = ops.linear(h, layer.wk, layer.bk).view(n, spec.n_head_kv, spec.head_dim)  # [N, Hkv, Dh]
        v = ops.linear(h, layer.wv, layer.bv).view(n, spec.n_head_kv, spec.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = ops.rms_norm(q, layer.q_norm, spec.rms_eps)
            k = ops.rms_norm(k, layer.k_norm, spec.rms_eps)
        swa = spec.swa_layers[il]
        rope = partial(ops.model_rope, pos=pos, spec=spec, swa=swa, freq_factors=self.rope_freqs)
        q, k = rope(q), rope(k)
        outs, off = [], 0
        for s in seqs:
            t = s.tokens.numel()
            # Write first, then read everything back: the current chunk's K/V go through the cache
            # type's rounding exactly as llama.cpp's do, whatever the chunking.
            s.cache.write(il, s.start, k[off : off + t], v[off : off + t])
            keys, values = s.cache.read(il, s.start + t)  # [start + t, Hkv, Dh]
            outs.append(
                ops.attention(
                    q[off : off + t],
                    keys,
                    values,
                    pos[off : off + t],
                    scale=spec.attn_scale,
                    window=spec.sliding_window if swa else 0,
                    softcap=spec.attn_softcap,
                )
            )
            off += t
        return ops.linear(torch.cat(outs), layer.wo, layer.bo)
