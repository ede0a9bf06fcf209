"""llama / qwen2 / qwen3 / gemma3 on the device backend (the twin of core/models/llama.py and
gemma3.py, which are the oracle: tests/cuda/test_device_models.py compares the two).

Weights stay quantized (``QuantWeight``) except the token embedding, which is dequantized once to a
float32 table on the device (rows are gathered by token id inside the step, so decode needs no
host-side lookup), and the small vectors (norm gammas, biases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import dense_moe
from mgserve.core.gguf.reader import GGUFFile
from mgserve.cuda.loader import Loader
from mgserve.cuda.models.base import Step, bias, load_embeddings, rows
from mgserve.cuda.models.moe import Moe, load_moe, moe_ffn
from mgserve.cuda.pools import PoolSize, SlotPools
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend


@dataclass
class DenseLayer:
    attn_norm: torch.Tensor  # [d]
    wq: QuantWeight
    wk: QuantWeight
    wv: QuantWeight
    wo: QuantWeight
    ffn_norm: torch.Tensor  # [d]
    gate: QuantWeight | None  # None in a layer of experts (llama, Mixtral-style)
    up: QuantWeight | None
    down: QuantWeight | None
    bq: torch.Tensor | None = None  # qwen2 (optional on every arch)
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim] qwen3, gemma3
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # gemma3
    post_ffn_norm: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # optional biases (llama.cpp: TENSOR_NOT_REQUIRED)
    gate_b: torch.Tensor | None = None
    up_b: torch.Tensor | None = None
    down_b: torch.Tensor | None = None
    moe: Moe | None = None  # llama with experts


class DenseLM:
    rewindable = True

    def __init__(
        self,
        g: GGUFFile,
        spec: ModelSpec,
        backend: Backend,
        device: torch.device,
        size: PoolSize,
    ) -> None:
        self.spec, self.backend, self.device = spec, backend, device
        ld = Loader(g, device)
        d, q, kv, ff = spec.n_embd, spec.q_dim, spec.kv_dim, spec.n_ff
        self.tok_embd, self.output = load_embeddings(ld, spec, backend)
        self.output_norm = ld.vec("output_norm.weight", (d,))
        self.output_b = ld.opt_vec("output.bias", (spec.n_vocab,))  # qwen2
        self.rope_freqs = (
            ld.vec("rope_freqs.weight", (spec.n_rot // 2,)) if ld.has("rope_freqs.weight") else None
        )
        self.experts = dense_moe(spec)
        dense = self.experts is None
        self.layers: list[DenseLayer] = []
        for il in range(spec.n_layer):
            p = f"blk.{il}."
            wq, wk, wv, (bq, bk, bv) = ld.qkv(p, d, q, kv, kv)
            layer = DenseLayer(
                attn_norm=ld.vec(p + "attn_norm.weight", (d,)),
                wq=wq,
                wk=wk,
                wv=wv,
                wo=ld.mat(p + "attn_output.weight", (q, d)),
                ffn_norm=ld.vec(p + "ffn_norm.weight", (d,)),
                gate=ld.mat(p + "ffn_gate.weight", (d, ff)) if dense else None,
                up=ld.mat(p + "ffn_up.weight", (d, ff)) if dense else None,
                down=ld.mat(p + "ffn_down.weight", (ff, d)) if dense else None,
                moe=None if self.experts is None else load_moe(ld, il, d, self.experts),
                bq=bq,
                bk=bk,
                bv=bv,
                bo=ld.opt_vec(p + "attn_output.bias", (d,)),
                gate_b=ld.opt_vec(p + "ffn_gate.bias", (ff,)),
                up_b=ld.opt_vec(p + "ffn_up.bias", (ff,)),
                down_b=ld.opt_vec(p + "ffn_down.bias", (d,)),
            )
            if spec.qk_norm:
                layer.q_norm = ld.vec(p + "attn_q_norm.weight", (spec.head_dim,))
                layer.k_norm = ld.vec(p + "attn_k_norm.weight", (spec.head_dim,))
            if spec.gemma:
                layer.post_attn_norm = ld.vec(p + "post_attention_norm.weight", (d,))
                layer.post_ffn_norm = ld.vec(p + "post_ffw_norm.weight", (d,))
            self.layers.append(layer)
        self.weight_bytes = ld.nbytes
        self.pools = SlotPools(size.n_slots, size.n_ctx)
        for il in range(spec.n_layer):
            self.pools.add_attention(
                il, size.type_k, size.type_v, spec.n_head_kv, spec.head_dim, device
            )

    def begin_sequence(self, slot: int) -> None:
        """Nothing only goes forward in a KV cache: positions are rewritten before they are read."""

    def step_extra(self, step_tokens: list[list[int]], slots: list[int]) -> None:
        return None

    def forward(self, step: Step) -> torch.Tensor:
        spec, b = self.spec, self.backend
        x = self.tok_embd.index_select(0, step.tokens)  # [N, d]
        if spec.gemma:
            x = x * math.sqrt(spec.n_embd)
        for il, layer in enumerate(self.layers):
            x = self.block(il, layer, x, step)
        h = b.norm.rms(rows(x, step), self.output_norm, spec.rms_eps)
        logits = bias(b.linear.matmul(h, self.output), self.output_b)
        if spec.final_softcap > 0.0:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

    def block(self, il: int, layer: DenseLayer, x: torch.Tensor, step: Step) -> torch.Tensor:
        b = self.backend
        eps = self.spec.rms_eps
        a = self.attend(il, layer, b.norm.rms(x, layer.attn_norm, eps), step)
        if layer.post_attn_norm is not None:
            a = b.norm.rms(a, layer.post_attn_norm, eps)
        x = x + a
        h = b.norm.rms(x, layer.ffn_norm, eps)
        if layer.moe is not None and self.experts is not None:
            return x + moe_ffn(b, layer.moe, h, self.experts)
        assert layer.gate is not None and layer.up is not None and layer.down is not None
        g = bias(b.linear.matmul(h, layer.gate), layer.gate_b)
        u = bias(b.linear.matmul(h, layer.up), layer.up_b)
        act = b.act.gelu_mul(g, u) if self.spec.gemma else b.act.silu_mul(g, u)
        m = bias(b.linear.matmul(act, layer.down), layer.down_b)
        if layer.post_ffn_norm is not None:
            m = b.norm.rms(m, layer.post_ffn_norm, eps)
        return x + m

    def attend(self, il: int, layer: DenseLayer, h: torch.Tensor, step: Step) -> torch.Tensor:
        spec, b = self.spec, self.backend
        n, dh = h.shape[0], spec.head_dim
        q = bias(b.linear.matmul(h, layer.wq), layer.bq)
        k = bias(b.linear.matmul(h, layer.wk), layer.bk)
        v = bias(b.linear.matmul(h, layer.wv), layer.bv)
        q, k, v = q.view(n, spec.n_head, dh), k.view(n, spec.n_head_kv, dh), v.view(n, -1, dh)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = b.norm.rms(q, layer.q_norm, spec.rms_eps)
            k = b.norm.rms(k, layer.k_norm, spec.rms_eps)
        swa = bool(spec.swa_layers and spec.swa_layers[il])
        base = spec.rope_base_swa if swa else spec.rope_base
        q, k = (
            b.rope.apply(t, step.pos, n_rot=spec.n_rot, base=base, neox=spec.rope_neox,
                         scale=spec.rope_scale, freq_factors=self.rope_freqs)
            for t in (q, k)
        )  # fmt: skip
        kc, vc = self.pools.k[il], self.pools.v[il]
        b.kv.write(kc, k, step.slots, step.pos)
        b.kv.write(vc, v, step.slots, step.pos)
        scale, softcap = spec.attn_scale, spec.attn_softcap
        window = spec.sliding_window if swa else 0
        if step.decode:
            lengths = step.pos + 1
            out = b.attention.decode(
                q, kc, vc, step.slots, lengths, scale=scale, window=window, softcap=softcap
            )
        else:
            parts, off = [], 0
            for s in step.spans:
                qs = q[off : off + s.n]
                parts.append(
                    b.attention.prefill(
                        qs, kc, vc, s.slot, s.start, scale=scale, window=window, softcap=softcap
                    )
                )
                off += s.n
            out = torch.cat(parts)
        return bias(b.linear.matmul(out, layer.wo), layer.bo)
