"""qwen3moe and qwen3next on the device backend, and the skeleton qwen4exp (qwen4exp.py) builds on:
the twin of core/models/decoder.py, hybrid.py, qwen3moe.py and qwen3next.py (the oracle;
tests/cuda/test_device_models.py compares them).

- qwen3moe: x += attn(norm(x)); x += moe(norm(x)). Attention is qwen3's (q/k norms, NeoX RoPE).
- qwen3next: Gated DeltaNet layers (deltanet.py) and gated full attention (q carries a sigmoid
  output gate, partial rotary); MoE with a sigmoid-gated shared expert (moe.py).

Decode reads only [B]-shaped device inputs (see models/base.py), so it captures into a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.reader import GGUFFile
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
from mgserve.cuda.models.deltanet import DeltaNet, deltanet_forward, load_deltanet
from mgserve.cuda.models.moe import Moe, load_moe, moe_ffn
from mgserve.cuda.models.qwen4exp_weights import HC, Indexer, Ple
from mgserve.cuda.ops.linear_tuning import Q8Activations
from mgserve.cuda.pools import KVLayer, PoolSize, SlotPools
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend
    from mgserve.cuda.plan_sizes import Part


@dataclass
class Attn:
    wq: QuantWeight  # [H * Dh (* 2 when gated), d]
    wk: QuantWeight
    wv: QuantWeight
    wo: QuantWeight
    q_norm: torch.Tensor  # [Dh]
    k_norm: torch.Tensor
    gated: bool
    biases: list[torch.Tensor | None]  # [bq, bk, bv]: optional, None where the file has none


@dataclass
class Layer:
    mixer: Attn | DeltaNet
    moe: Moe
    attn_norm: torch.Tensor | None = None  # qwen3moe / qwen3next
    ffn_norm: torch.Tensor | None = None
    hc_attn: HC | None = None  # qwen4exp
    hc_ffn: HC | None = None
    indexer: Indexer | None = None
    ple: Ple | None = None


def load_attn(ld: Loader, il: int, spec: ModelSpec, hp: HybridSpec) -> Attn:
    d, p, q, kv = spec.n_embd, f"blk.{il}.", spec.q_dim, spec.kv_dim
    wq, wk, wv, biases = ld.qkv(p, d, 2 * q if hp.attn_gated else q, kv, kv)
    return Attn(
        wq=wq,
        wk=wk,
        wv=wv,
        wo=ld.mat(p + "attn_output.weight", (q, d)),
        q_norm=ld.vec(p + "attn_q_norm.weight", (spec.head_dim,)),
        k_norm=ld.vec(p + "attn_k_norm.weight", (spec.head_dim,)),
        gated=hp.attn_gated,
        biases=biases,
    )


class HybridLM(Staged):
    decode_extra_shape: tuple[int, ...] | None = None  # [...] of Step.extra rows in decode

    def __init__(
        self,
        g: GGUFFile,
        spec: ModelSpec,
        hp: HybridSpec,
        backend: Backend,
        device: torch.device,
        size: PoolSize,
        part: Part | None = None,
    ) -> None:
        self.spec, self.hp, self.backend, self.device = spec, hp, backend, device
        self.arch = spec.arch
        self.handoff_shape: tuple[int, ...] = (spec.n_embd,)  # per token, between stages
        self.rewindable = not any(hp.recurrent)
        self.read_extras(g)
        ld = Loader(g, device)
        self.tok_embd, self.output = load_embeddings(ld, spec, backend, part)
        if part is None or part.last:
            self.load_head(ld)
        # by index: a stage's own layers (models/base.py)
        self.layers = {il: self.load_layer(ld, il) for il in owned(part, spec.n_layer)}
        self.weight_bytes = ld.nbytes
        self.pools = SlotPools(size.n_slots, size.n_ctx)
        for il in self.layers:
            if hp.recurrent[il]:
                self.pools.add_recurrent(
                    il, hp.ssm_conv, hp.conv_dim, hp.ssm_v_heads, hp.ssm_head_dim, device
                )
            else:
                self.pools.add_attention(
                    il, size.type_k, size.type_v, spec.n_head_kv, spec.head_dim, device
                )
        self.add_pools()

    # -- loading (qwen4exp.py extends each step) ---------------------------------------------

    def read_extras(self, g: GGUFFile) -> None:
        """What the architecture reads from the file besides the layers' tensors (first)."""

    def add_pools(self) -> None:
        """Per-slot state of the architecture's own besides K/V and DeltaNet states (last)."""

    output_norm: torch.Tensor | None = None  # the last stage's (load_head)

    def load_head(self, ld: Loader) -> None:
        self.output_norm = ld.vec("output_norm.weight", (self.spec.n_embd,))

    def load_mixer(self, ld: Loader, il: int) -> Attn | DeltaNet:
        if self.hp.recurrent[il]:
            return load_deltanet(ld, il, self.spec.n_embd, self.hp, self.arch)
        return load_attn(ld, il, self.spec, self.hp)

    def load_layer(self, ld: Loader, il: int) -> Layer:
        d, p = self.spec.n_embd, f"blk.{il}."
        norm2 = "post_attention_norm" if self.arch == "qwen3next" else "ffn_norm"
        return Layer(
            mixer=self.load_mixer(ld, il),
            moe=load_moe(ld, il, d, self.hp),
            attn_norm=ld.vec(p + "attn_norm.weight", (d,)),
            ffn_norm=ld.vec(p + f"{norm2}.weight", (d,)),
        )

    # -- sessions ----------------------------------------------------------------------------

    def begin_sequence(self, slot: int) -> None:
        self.pools.reset_slot(slot)

    def step_extra(
        self, step_tokens: list[list[int]], slots: list[int], packed: bool = False
    ) -> torch.Tensor | None:
        return None

    def host_state(self, slot: int) -> Any:
        return None

    def set_host_state(self, slot: int, state: Any) -> None:
        """Nothing on the host: the recurrent state is all in the pools."""

    # -- the forward -------------------------------------------------------------------------

    # as stages (models/base.py ``Staged``: forward runs all three on every layer)

    def stage_in(self, step: Step) -> torch.Tensor:
        return self.embed(step)

    def stage_layers(self, x: torch.Tensor, step: Step, start: int, stop: int) -> torch.Tensor:
        for il in range(start, stop):
            x = self.block(il, x, step)
            step.layer_done()
        return x

    def stage_out(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        return self.backend.linear.matmul(self.head(rows(x, step)), loaded(self.output, "the head"))

    def embed(self, step: Step) -> torch.Tensor:
        table = loaded(self.tok_embd, "the token embedding")
        return self.backend.embed.gather(table, step.tokens)  # [N, d]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.norm.rms(x, loaded(self.output_norm, "the head"), self.spec.rms_eps)

    def block(self, il: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x + mixer(norm(x)), then + moe(norm(x)): each residual added by the op that ends the
        branch (the output projection, the experts' sum)."""
        layer, b, eps = self.layers[il], self.backend, self.spec.rms_eps
        assert layer.attn_norm is not None and layer.ffn_norm is not None
        h = b.norm.rms(x, layer.attn_norm, eps, f16=True)  # (f16: the GEMMs' copy)
        x = self.mixer(il, layer, h, step, residual=x)
        h = b.norm.rms(x, layer.ffn_norm, eps, f16=True)
        return moe_ffn(b, layer.moe, h, self.hp, residual=x)

    def mixer(self, il: int, layer: Layer, h: torch.Tensor, step: Step,
              residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """residual + the layer's mixer (DeltaNet or attention) on the normed input h."""
        if isinstance(layer.mixer, DeltaNet):
            return deltanet_forward(
                self.backend, self.pools, il, layer.mixer, h, step, self.hp, self.spec.rms_eps,
                residual,
            )  # fmt: skip
        return self.attention(il, layer, layer.mixer, h, step, residual)

    def rotate(self, x: torch.Tensor, norm: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm then NeoX RoPE of x [N, H, D] (rows may be strided) at pos [N], in
        one op (every rotary input of the family)."""
        spec = self.spec
        return self.backend.rope.norm_apply(
            x, norm, spec.rms_eps, pos, n_rot=spec.n_rot, base=spec.rope_base, neox=True,
            scale=spec.rope_scale,
        )  # fmt: skip

    def attention(self, il: int, layer: Layer, w: Attn, h: torch.Tensor, step: Step,
                  residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        spec, b = self.spec, self.backend
        n, dh = h.shape[0], spec.head_dim
        xq = b.linear.quantize(h)
        kc, vc = self.pools.k[il], self.pools.v[il]
        side = b.branch.fork()  # decode: k and v into the cache beside q
        with side:
            k = b.linear.matmul(h, w.wk, bias=w.biases[1], xq=xq).view(n, spec.n_head_kv, dh)
            v = b.linear.matmul(h, w.wv, bias=w.biases[2], xq=xq).view(n, spec.n_head_kv, dh)
            k = self.rotate(k, w.k_norm, step.pos)
            b.kv.write(kc, k, step.slots, step.pos)
            b.kv.write(vc, v, step.slots, step.pos)
        q = b.linear.matmul(h, w.wq, bias=w.biases[0], xq=xq).view(n, spec.n_head, -1)
        gate = None
        if w.gated:  # per head [q | gate]: both read in place
            q, gate = q[..., :dh], q[..., dh:]
        q = self.rotate(q, w.q_norm, step.pos)
        side.join()
        out = self.attend(il, layer, q, kc, vc, h, step, xq)  # [N, H * D]
        oq = None
        if gate is not None:  # the gate kernel writes wo's int8 input too
            fuse = b.linear.fused_xq(n, spec.n_head * dh)
            gated, oq = b.act.sigmoid_mul_xq(gate, out.view(n, spec.n_head, dh), xq=fuse)
            out = gated.view(n, -1)
        return b.linear.matmul(out, w.wo, residual=residual, xq=oq)

    def attend(self, il: int, layer: Layer, q: torch.Tensor, kc: KVLayer, vc: KVLayer,
               h: torch.Tensor, step: Step, xq: Q8Activations | None) -> torch.Tensor:  # fmt: skip
        """Causal attention of the step's queries q [N, H, D] over the pools: [N, H * D] (h, the
        layer's normed input, and its int8 form xq: for qwen4exp's indexer)."""
        b, scale = self.backend, self.spec.attn_scale
        if step.decode:
            return b.attention.decode(q, kc, vc, step.slots, key_lengths(step), scale=scale)
        parts, off = [], 0
        for s in step.spans:
            qs = q[off : off + s.n]
            parts.append(b.attention.prefill(qs, kc, vc, s.slot, s.start, scale=scale))
            off += s.n
        return torch.cat(parts)
