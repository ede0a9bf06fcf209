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
from mgserve.core.reference import rowwise
from mgserve.cuda.loader import Loader
from mgserve.cuda.models.base import (
    Staged,
    Step,
    key_lengths,
    load_embeddings,
    loaded,
    owned,
    rows,
)
from mgserve.cuda.models.moe import Moe, load_moe, moe_ffn
from mgserve.cuda.pools import PoolSize, SlotPools
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend
    from mgserve.cuda.plan_sizes import Part


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


class DenseLM(Staged):
    rewindable = True

    def __init__(
        self,
        g: GGUFFile,
        spec: ModelSpec,
        backend: Backend,
        device: torch.device,
        size: PoolSize,
        part: Part | None = None,
    ) -> None:
        self.spec, self.backend, self.device = spec, backend, device
        self.handoff_shape = (spec.n_embd,)
        ld = Loader(g, device)
        d, q, kv, ff = spec.n_embd, spec.q_dim, spec.kv_dim, spec.n_ff
        self.tok_embd, self.output = load_embeddings(ld, spec, backend, part)
        last = part is None or part.last
        self.output_norm = ld.vec("output_norm.weight", (d,)) if last else None
        self.output_b = ld.opt_vec("output.bias", (spec.n_vocab,)) if last else None  # qwen2
        self.rope_freqs = (
            ld.vec("rope_freqs.weight", (spec.n_rot // 2,)) if ld.has("rope_freqs.weight") else None
        )
        self.experts = dense_moe(spec)
        dense = self.experts is None
        self.layers: dict[int, DenseLayer] = {}  # by index: a stage's own (models/base.py)
        for il in owned(part, spec.n_layer):
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
            self.layers[il] = layer
        self.weight_bytes = ld.nbytes
        self.pools = SlotPools(size.n_slots, size.n_ctx)
        for il in self.layers:
            self.pools.add_attention(
                il, size.type_k, size.type_v, spec.n_head_kv, spec.head_dim, device
            )

    def begin_sequence(self, slot: int) -> None:
        """Nothing only goes forward in a KV cache: positions are rewritten before they are read."""

    def step_extra(
        self, step_tokens: list[list[int]], slots: list[int], packed: bool = False
    ) -> None:
        return None

    def host_state(self, slot: int) -> None:
        return None

    def set_host_state(self, slot: int, state: None) -> None:
        """Nothing on the host (and no checkpoints: a KV cache rewinds)."""

    # the forward as stages (models/base.py ``Staged``): forward runs all three on every layer

    def stage_in(self, step: Step) -> torch.Tensor:
        """The token embedding [N, d] (scaled by sqrt(d) in gemma)."""
        scale = math.sqrt(self.spec.n_embd) if self.spec.gemma else 1.0
        table = loaded(self.tok_embd, "the token embedding")
        return self.backend.embed.gather(table, step.tokens, scale=scale)

    def stage_layers(self, x: torch.Tensor, step: Step, start: int, stop: int) -> torch.Tensor:
        for il in range(start, stop):
            x = self.block(il, self.layers[il], x, step)
            step.layer_done()
        return x

    def stage_out(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        spec, b = self.spec, self.backend
        h = b.norm.rms(rows(x, step), loaded(self.output_norm, "the head"), spec.rms_eps)
        logits = b.linear.matmul(h, loaded(self.output, "the head"), bias=self.output_b)
        if spec.final_softcap > 0.0:  # gemma2-style files only
            logits = rowwise.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

    def block(self, il: int, layer: DenseLayer, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x + attn(norm(x)), then + mlp(norm(x)): each residual added by the op that ends the
        branch (the output projection, or Gemma's post-norm)."""
        b = self.backend
        eps = self.spec.rms_eps
        h = b.norm.rms(x, layer.attn_norm, eps, f16=True)
        if layer.post_attn_norm is not None:
            a = self.attend(il, layer, h, step)
            x = b.norm.rms(a, layer.post_attn_norm, eps, residual=x)
        else:
            x = self.attend(il, layer, h, step, residual=x)
        h = b.norm.rms(x, layer.ffn_norm, eps, f16=True)
        if layer.moe is not None and self.experts is not None:
            return moe_ffn(b, layer.moe, h, self.experts, residual=x)
        assert layer.gate is not None and layer.up is not None and layer.down is not None
        xq = b.linear.quantize(h)
        g = b.linear.matmul(h, layer.gate, bias=layer.gate_b, xq=xq)
        u = b.linear.matmul(h, layer.up, bias=layer.up_b, xq=xq)
        act = b.act.gelu_mul(g, u) if self.spec.gemma else b.act.silu_mul(g, u)
        if layer.post_ffn_norm is None:
            return b.linear.matmul(act, layer.down, bias=layer.down_b, residual=x)
        m = b.linear.matmul(act, layer.down, bias=layer.down_b)
        return b.norm.rms(m, layer.post_ffn_norm, eps, residual=x)

    def rotate(
        self, x: torch.Tensor, norm: torch.Tensor | None, pos: torch.Tensor, swa: bool
    ) -> torch.Tensor:
        """RoPE of x [N, H, D] at pos, after the per-head RMSNorm ``norm`` (qwen3, gemma3) in the
        same op."""
        spec, rope = self.spec, self.backend.rope
        base = spec.rope_base_swa if swa else spec.rope_base
        if norm is None:
            return rope.apply(
                x, pos, n_rot=spec.n_rot, base=base, neox=spec.rope_neox, scale=spec.rope_scale,
                freq_factors=self.rope_freqs,
            )  # fmt: skip
        return rope.norm_apply(
            x, norm, spec.rms_eps, pos, n_rot=spec.n_rot, base=base, neox=spec.rope_neox,
            scale=spec.rope_scale, freq_factors=self.rope_freqs,
        )  # fmt: skip

    def attend(self, il: int, layer: DenseLayer, h: torch.Tensor, step: Step,
               residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """residual + the attention branch's output [N, d] for the normed input h."""
        spec, b = self.spec, self.backend
        n, dh = h.shape[0], spec.head_dim
        xq = b.linear.quantize(h)
        q = b.linear.matmul(h, layer.wq, bias=layer.bq, xq=xq).view(n, spec.n_head, dh)
        k = b.linear.matmul(h, layer.wk, bias=layer.bk, xq=xq).view(n, spec.n_head_kv, dh)
        v = b.linear.matmul(h, layer.wv, bias=layer.bv, xq=xq).view(n, -1, dh)
        swa = bool(spec.swa_layers and spec.swa_layers[il])
        q, k = (
            self.rotate(q, layer.q_norm, step.pos, swa),
            self.rotate(k, layer.k_norm, step.pos, swa),
        )
        kc, vc = self.pools.k[il], self.pools.v[il]
        b.kv.write(kc, k, step.slots, step.pos)
        b.kv.write(vc, v, step.slots, step.pos)
        scale, softcap = spec.attn_scale, spec.attn_softcap
        window = spec.sliding_window if swa else 0
        if step.decode:
            out = b.attention.decode(
                q, kc, vc, step.slots, key_lengths(step), scale=scale, window=window,
                softcap=softcap,
            )  # fmt: skip
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
        return b.linear.matmul(out, layer.wo, bias=layer.bo, residual=residual)
