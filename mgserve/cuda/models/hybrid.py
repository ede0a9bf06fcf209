"""qwen3moe, qwen3next and qwen4exp on the device backend: the twin of core/models/qwen3moe.py,
qwen3next.py and qwen4exp.py (the oracle; tests/cuda/test_device_models.py compares them).

One class for the family, switched by the architecture:

- qwen3moe: x += attn(norm(x)); x += moe(norm(x)). Attention is qwen3's (q/k norms, NeoX RoPE).
- qwen3next: Gated DeltaNet layers and gated full attention (q carries a sigmoid output gate,
  partial rotary); MoE with a sigmoid-gated shared expert.
- qwen4exp: qwen3next's layers on hyper-connection streams [N, hc, d] (mix / combine in place of
  the norms), QSA block-sparse attention, and the PLE n-gram embedding on one layer.

Device layout notes:
- qwen4exp files store DeltaNet value heads tiled (value head j reads key head j % H_k). The rows
  of the projections that produce value heads (qkv's v part, z, beta, alpha) are reordered at load
  into the grouped order the kernels use (j reads j // r); ``ssm_out`` reads value heads along its
  input, which block quantization cannot reorder, so its input is put back into the file's order
  instead (one gather per layer).
- Decode reads only [B]-shaped device inputs (see models/base.py), so it captures into a graph;
  QSA's block keys are pooled on the device as blocks complete, PLE rows are hashed and gathered on
  the host and handed over as ``Step.extra``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.hparams_qwen4exp import Qwen4ExpSpec, qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.models.hybrid_weights import ssm_in_rows
from mgserve.core.reference import ple as ple_ref
from mgserve.core.reference import rowwise
from mgserve.cuda.kbase import KVLayer
from mgserve.cuda.loader import Loader, select_rows
from mgserve.cuda.models.base import DeviceOps, Step, rows
from mgserve.cuda.models.dense import load_embeddings
from mgserve.cuda.models.moe import Moe, load_moe, moe_ffn
from mgserve.cuda.pools import SlotPools
from mgserve.cuda.weights import QuantWeight

HC_FUSED_MAX_TOKENS = 16  # larger batches (prompt chunks) mix the streams with GEMMs
DELTA_CHUNK = 128  # tokens per step of the chunked delta rule in prefill (same results as 64)


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
class DeltaNet:
    qkv: QuantWeight  # [conv_dim, d] rows [q | k | v (grouped value heads)]
    z: QuantWeight  # [value_dim, d] (grouped)
    beta: QuantWeight  # [H_v, d] (grouped)
    alpha: QuantWeight  # [H_v, d]
    conv: torch.Tensor  # [conv_dim, K]
    dt_bias: torch.Tensor  # [H_v]
    a: torch.Tensor  # [H_v]
    norm: torch.Tensor  # [d_v]
    out: QuantWeight  # [d, value_dim] in the file's value-head order
    out_order: torch.Tensor | None  # [H_v] int64: grouped heads -> the order ``out`` reads
    sigmoid_gate: bool


@dataclass
class HC:
    norm: torch.Tensor  # [hc, d]
    down: QuantWeight  # [r, hc * d]
    up: QuantWeight  # [hc * d, r]
    inject: QuantWeight | None  # [hc, hc * d]


@dataclass
class Indexer:
    q_proj: QuantWeight  # [H_idx * D, d]
    k_proj: QuantWeight  # [D, d]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor


@dataclass
class Ple:
    key: QuantWeight  # [hc * d, n_heads * head_dim]
    value: QuantWeight  # [d, n_heads * head_dim]
    norm_key: torch.Tensor  # [hc, d]
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    conv: torch.Tensor  # [hc * d, K]


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


def _grouped_from_tiled(hp: HybridSpec) -> torch.Tensor:
    """[H_v] int64: for each grouped value head j (reads key head j // r), its index in the tiled
    order qwen4exp files use (reads key head t % H_k)."""
    hk, r = hp.ssm_k_heads, hp.ssm_v_heads // hp.ssm_k_heads
    j = torch.arange(hp.ssm_v_heads)
    return (j % r) * hk + j // r


def _bias(x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x if b is None else x + b


def _head_rows(heads: torch.Tensor, width: int) -> torch.Tensor:
    """Row indices of whole heads of ``width`` rows each, in the order ``heads`` lists them."""
    return (heads[:, None] * width + torch.arange(width)).flatten()


class HybridLM:
    def __init__(
        self,
        g: GGUFFile,
        spec: ModelSpec,
        hp: HybridSpec,
        ops: DeviceOps,
        device: torch.device,
        n_slots: int,
        n_ctx: int,
        type_k: str = "f16",
        type_v: str = "f16",
    ) -> None:
        self.spec, self.hp, self.ops, self.device = spec, hp, ops, device
        self.arch = spec.arch
        self.rewindable = not any(hp.recurrent)
        self.qp: Qwen4ExpSpec | None = None
        if self.arch == "qwen4exp":
            self.qp = qwen4exp_spec_from_gguf(g, hp.recurrent, spec.n_rot)
        ld = Loader(g, device)
        d = spec.n_embd
        self.tok_embd, self.output = load_embeddings(ld, spec, ops)
        self.output_norm: torch.Tensor | None = None
        self.output_hc: HC | None = None
        if self.qp is not None:
            self.output_hc = self._hc(ld, "output_hc", inject=False)
        else:
            self.output_norm = ld.vec("output_norm.weight", (d,))
        self.ple_table = None
        self.decode_extra_shape: tuple[int, ...] | None = None
        if self.qp is not None and self.qp.ple is not None:
            p = self.qp.ple
            self.ple_table = g.tensor("per_layer_token_embd.weight")  # stays memory-mapped
            ple_ref.check_table(self.ple_table, p, g.path)
            ple_ref.advise_random(self.ple_table)
            self.decode_extra_shape = (p.n_heads * p.head_dim,)
        self.layers = [self._layer(ld, il) for il in range(spec.n_layer)]
        self.weight_bytes = ld.nbytes

        self.pools = SlotPools(n_slots, n_ctx)
        for il in range(spec.n_layer):
            if hp.recurrent[il]:
                self.pools.add_recurrent(
                    il, hp.ssm_conv, hp.conv_dim, hp.ssm_v_heads, hp.ssm_head_dim, device
                )
            else:
                self.pools.add_attention(il, type_k, type_v, spec.n_head_kv, spec.head_dim, device)
            if self.layers[il].indexer is not None:
                assert self.qp is not None
                self.pools.add_qsa(il, self.qp.ratio, self.qp.idx_dim, device)
        if self.qp is not None and self.qp.ple is not None:
            hist = self.qp.ple.history
            self.pools.ple_conv = torch.zeros(n_slots, hist, self.qp.hc * d, device=device)
        # the last ngram - 1 tokens of each slot, for the host-side n-gram hash
        self._ple_tokens: dict[int, np.ndarray] = {}

    # -- loading -----------------------------------------------------------------------------

    def _hc(self, ld: Loader, prefix: str, inject: bool) -> HC:
        qp = self.qp
        assert qp is not None
        d = self.spec.n_embd
        hc_dim, lr = qp.hc * d, qp.hc_lowrank
        return HC(
            norm=ld.vec(f"{prefix}_norm.weight", (d, qp.hc), reshape_ok=True),  # [hc, d]
            down=ld.mat(f"{prefix}_down.weight", (hc_dim, lr)),
            up=ld.mat(f"{prefix}_up.weight", (lr, hc_dim)),
            inject=ld.mat(f"{prefix}_inject.weight", (hc_dim, qp.hc)) if inject else None,
        )

    def _layer(self, ld: Loader, il: int) -> Layer:
        hp, qp, d = self.hp, self.qp, self.spec.n_embd
        p = f"blk.{il}."
        mixer: Attn | DeltaNet = self._deltanet(ld, il) if hp.recurrent[il] else self._attn(ld, il)
        layer = Layer(mixer=mixer, moe=load_moe(ld, il, self.spec.n_embd, self.hp))
        if qp is None:
            layer.attn_norm = ld.vec(p + "attn_norm.weight", (d,))
            norm2 = "post_attention_norm" if self.arch == "qwen3next" else "ffn_norm"
            layer.ffn_norm = ld.vec(p + f"{norm2}.weight", (d,))
            return layer
        layer.hc_attn = self._hc(ld, p + "hc_attn", inject=True)
        layer.hc_ffn = self._hc(ld, p + "hc_ffn", inject=True)
        if qp.compress[il]:
            dim = qp.idx_dim
            layer.indexer = Indexer(
                q_proj=ld.mat(p + "indexer.q_proj.weight", (d, qp.idx_heads * dim)),
                k_proj=ld.mat(p + "indexer.k_proj.weight", (d, dim)),
                q_norm=ld.vec(p + "indexer.q_norm.weight", (dim,)),
                k_norm=ld.vec(p + "indexer.k_norm.weight", (dim,)),
            )
        if qp.ple is not None and qp.ple.layer == il:
            emb, hc_dim = qp.ple.n_heads * qp.ple.head_dim, qp.hc * d
            layer.ple = Ple(
                key=ld.mat(p + "ple_key.weight", (emb, hc_dim)),
                value=ld.mat(p + "ple_value.weight", (emb, d)),
                norm_key=ld.vec(p + "ple_norm_key.weight", (d, qp.hc), reshape_ok=True),
                norm_query=ld.vec(p + "ple_norm_query.weight", (d, qp.hc), reshape_ok=True),
                norm_conv=ld.vec(p + "ple_norm_conv.weight", (d, qp.hc), reshape_ok=True),
                conv=ld.vec(p + "ple_conv1d.weight", (qp.ple.conv_kernel, hc_dim)),
            )
        return layer

    def _attn(self, ld: Loader, il: int) -> Attn:
        spec, hp, d, p = self.spec, self.hp, self.spec.n_embd, f"blk.{il}."
        q, kv = spec.q_dim, spec.kv_dim
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

    def _deltanet(self, ld: Loader, il: int) -> DeltaNet:
        hp, d, p = self.hp, self.spec.n_embd, f"blk.{il}."
        hv, hk, dv, kd = hp.ssm_v_heads, hp.ssm_k_heads, hp.ssm_head_dim, hp.key_dim
        r = hv // hk
        if ld.has(p + "attn_qkv.weight"):
            qkv = ld.mat(p + "attn_qkv.weight", (d, hp.conv_dim))
            z = ld.mat(p + "attn_gate.weight", (d, hp.value_dim))
        elif ld.has(p + "ssm_in.weight") and self.arch == "qwen3next":  # legacy fused [q|k|v|z]
            fused = ld.mat(p + "ssm_in.weight", (d, hp.conv_dim + hp.value_dim))
            qkv_rows, z_rows = ssm_in_rows(hp)
            qkv, z = select_rows(fused, qkv_rows), select_rows(fused, z_rows)
        else:
            raise GGUFError(f"{ld.g.path}: layer {il} has neither 'attn_qkv' nor 'ssm_in'")
        conv = ld.vec(p + "ssm_conv1d.weight", (hp.ssm_conv, hp.conv_dim))  # [conv_dim, K]
        dt_bias = ld.vec(p + "ssm_dt.bias", (hv,))
        a = ld.vec(p + "ssm_a", (hv,))
        out = ld.mat(p + "ssm_out.weight", (hp.value_dim, d))
        if self.arch == "qwen4exp":
            heads = _grouped_from_tiled(hp)  # grouped head j <- tiled head heads[j]
            v_rows = 2 * kd + _head_rows(heads, dv)
            qkv = select_rows(qkv, torch.cat((torch.arange(2 * kd), v_rows)))
            z = select_rows(z, _head_rows(heads, dv))
            v_taps = conv[2 * kd :].view(hv, dv, -1)[heads.to(conv.device)]  # [H_v, d_v, K]
            conv = torch.cat((conv[: 2 * kd], v_taps.reshape(-1, conv.shape[1])))
            dt_bias, a = dt_bias[heads.to(dt_bias.device)], a[heads.to(a.device)]
            beta = select_rows(ld.mat(p + "ssm_beta.weight", (d, hv)), heads)
            alpha = select_rows(ld.mat(p + "ssm_alpha.weight", (d, hv)), heads)
            order = torch.argsort(heads).to(self.device)  # tiled head t <- grouped head order[t]
        else:
            ba = ld.mat(p + "ssm_ba.weight", (d, 2 * hv))  # per key head: [beta (r) | alpha (r)]
            j = torch.arange(hv)
            beta = select_rows(ba, (j // r) * 2 * r + j % r)
            alpha = select_rows(ba, (j // r) * 2 * r + r + j % r)
            order = None
        return DeltaNet(
            qkv=qkv, z=z, beta=beta, alpha=alpha, conv=conv.contiguous(), dt_bias=dt_bias, a=a,
            norm=ld.vec(p + "ssm_norm.weight", (dv,)), out=out, out_order=order,
            sigmoid_gate=self.arch == "qwen4exp",
        )  # fmt: skip

    # -- sessions ----------------------------------------------------------------------------

    def begin_sequence(self, slot: int) -> None:
        self.pools.reset_slot(slot)
        if self.qp is not None and self.qp.ple is not None:
            p = self.qp.ple
            self._ple_tokens[slot] = np.full(p.ngram - 1, p.eos, dtype=np.int64)

    def step_extra(self, step_tokens: list[list[int]], slots: list[int]) -> torch.Tensor | None:
        """qwen4exp: the PLE rows of the step's tokens [N, n_heads * head_dim] (host float32),
        hashed with each slot's token history, which this advances."""
        if self.ple_table is None:
            return None
        assert self.qp is not None and self.qp.ple is not None
        p = self.qp.ple
        found = []
        for toks, slot in zip(step_tokens, slots, strict=True):
            hist = self._ple_tokens.get(slot)
            if hist is None:
                hist = self._ple_tokens[slot] = np.full(p.ngram - 1, p.eos, dtype=np.int64)
            t = np.asarray(toks, dtype=np.int64)
            found.append(ple_ref.ngram_rows(t, hist, p))
            seq = np.concatenate((hist, t))
            self._ple_tokens[slot] = seq[seq.size - hist.size :]
        emb = ple_ref.gather_rows(self.ple_table, np.concatenate(found))  # [N, heads, dim]
        return emb.flatten(1)

    # -- the forward -------------------------------------------------------------------------

    def forward(self, step: Step) -> torch.Tensor:
        spec = self.spec
        x = self.tok_embd.index_select(0, step.tokens)  # [N, d]
        if self.qp is not None:
            x = x[:, None, :].repeat(1, self.qp.hc, 1)  # [N, hc, d]
        for il in range(spec.n_layer):
            x = self.block(il, x, step)
        x = rows(x, step)
        if self.output_hc is not None:
            h, _ = self.hc_mix(x, self.output_hc)
        else:
            assert self.output_norm is not None
            h = self.ops.rms_norm(x, self.output_norm, spec.rms_eps)
        return self.ops.linear(h, self.output)

    def block(self, il: int, x: torch.Tensor, step: Step) -> torch.Tensor:
        layer, ops, eps = self.layers[il], self.ops, self.spec.rms_eps
        if layer.hc_attn is None:
            assert layer.attn_norm is not None and layer.ffn_norm is not None
            h = ops.rms_norm(x, layer.attn_norm, eps)
            x = x + self.mixer(il, layer, h, step)
            h = ops.rms_norm(x, layer.ffn_norm, eps)
            return x + moe_ffn(self.ops, layer.moe, h, self.hp)
        assert layer.hc_ffn is not None
        if layer.ple is not None:
            x = x + self.ple(layer.ple, x, step)
        h, inject = self.hc_mix(x, layer.hc_attn)
        assert inject is not None
        x = self.ops.hc_combine(x, self.mixer(il, layer, h, step), inject)
        h, inject = self.hc_mix(x, layer.hc_ffn)
        assert inject is not None
        return self.ops.hc_combine(x, moe_ffn(self.ops, layer.moe, h, self.hp), inject)

    def mixer(self, il: int, layer: Layer, h: torch.Tensor, step: Step) -> torch.Tensor:
        if isinstance(layer.mixer, DeltaNet):
            return self.deltanet(il, layer.mixer, h, step)
        return self.attention(il, layer, layer.mixer, h, step)

    def hc_mix(self, x: torch.Tensor, w: HC) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hyper_connections.mix: what a block reads [N, d], and its inject weights [N, hc].

        Decode-sized batches take the fused kernels (weights read once per group of 8 tokens);
        a prompt chunk takes three GEMMs, which read each weight once for the whole chunk."""
        ops, eps = self.ops, self.spec.rms_eps
        n, hc, d = x.shape
        if n <= HC_FUSED_MAX_TOKENS:
            return ops.hc_mix(x, w.norm, w.down, w.up, w.inject, eps)
        xn = ops.rms_norm(x, w.norm, eps).reshape(n, hc * d)  # [N, hc * d]
        low = rowwise.silu(ops.linear(xn, w.down) / hc)  # [N, r]
        gate = rowwise.sigmoid(ops.linear(low, w.up))  # [N, hc * d]
        mixed = (gate * xn).view(n, hc, d).mean(dim=1)  # [N, d]
        if w.inject is None:
            return mixed, None
        return mixed, 2.0 * rowwise.sigmoid(ops.linear(xn, w.inject) / hc)

    def attention(
        self, il: int, layer: Layer, w: Attn, h: torch.Tensor, step: Step
    ) -> torch.Tensor:
        spec, ops = self.spec, self.ops
        n, dh = h.shape[0], spec.head_dim
        q = _bias(ops.linear(h, w.wq), w.biases[0]).view(n, spec.n_head, -1)
        gate = None
        if w.gated:
            q, gate = q[..., :dh].contiguous(), q[..., dh:].reshape(n, spec.n_head * dh)
        k = _bias(ops.linear(h, w.wk), w.biases[1]).view(n, spec.n_head_kv, dh)
        v = _bias(ops.linear(h, w.wv), w.biases[2]).view(n, spec.n_head_kv, dh)
        rope = dict(n_rot=spec.n_rot, base=spec.rope_base, neox=True, scale=spec.rope_scale)
        q = ops.rope(ops.rms_norm(q, w.q_norm, spec.rms_eps), step.pos, **rope)
        k = ops.rope(ops.rms_norm(k, w.k_norm, spec.rms_eps), step.pos, **rope)
        kc, vc = self.pools.k[il], self.pools.v[il]
        ops.kv_write(kc, k, step.slots, step.pos)
        ops.kv_write(vc, v, step.slots, step.pos)
        scale = spec.attn_scale
        if layer.indexer is not None:
            out = self.sparse(il, layer.indexer, q, kc, vc, h, step)
        elif step.decode:
            out = ops.attention_decode(q, kc, vc, step.slots, step.pos + 1, scale=scale)
        else:
            parts, off = [], 0
            for s in step.spans:
                qs = q[off : off + s.n]
                parts.append(ops.attention_prefill(qs, kc, vc, s.slot, s.start, scale=scale))
                off += s.n
            out = torch.cat(parts)
        if gate is not None:
            out = out * rowwise.sigmoid(gate)
        return ops.linear(out, w.wo)

    # -- QSA ---------------------------------------------------------------------------------

    def sparse(self, il: int, w: Indexer, q: torch.Tensor, kc: KVLayer, vc: KVLayer,
               h: torch.Tensor, step: Step) -> torch.Tensor:  # fmt: skip
        """Pool the blocks this step completes, then QSA attention over the selected cells."""
        spec, ops, qp = self.spec, self.ops, self.qp
        assert qp is not None
        n, dim, r = h.shape[0], qp.idx_dim, qp.ratio
        rope = dict(n_rot=spec.n_rot, base=spec.rope_base, neox=True, scale=spec.rope_scale)
        iq = ops.linear(h, w.q_proj).view(n, qp.idx_heads, dim)
        iq = ops.rope(ops.rms_norm(iq, w.q_norm, spec.rms_eps), step.pos, **rope)
        raw = ops.linear(h, w.k_proj)  # [N, D]
        blocks, pending = self.pools.blocks[il], self.pools.pending[il]
        kw = dict(ratio=r, budget=qp.idx_budget, scale=spec.attn_scale)
        if step.decode:
            slots, pos = step.slots.long(), step.pos.long()
            pending[slots, pos % r] = raw
            first = (pos + 1 - r).clamp_min(0)  # the block's first position, once complete
            pooled = self.pool_blocks(pending.index_select(0, slots), first, w)  # [B, D]
            done = ((pos + 1) % r == 0)[:, None]
            b = pos // r
            blocks[slots, b] = torch.where(done, pooled, blocks[slots, b])
            return ops.qsa_decode(q, iq, kc, vc, blocks, step.slots, step.pos + 1, **kw)
        parts, off = [], 0
        for s in step.spans:
            buf = torch.cat((pending[s.slot, : s.start % r], raw[off : off + s.n]))
            first_block, n_new = s.start // r, buf.shape[0] // r
            if n_new:
                starts = (first_block + torch.arange(n_new, device=h.device)) * r
                whole = buf[: n_new * r].view(n_new, r, dim)
                new_blocks = slice(first_block, first_block + n_new)
                blocks[s.slot, new_blocks] = self.pool_blocks(whole, starts, w)
            rest = buf[n_new * r :]
            pending[s.slot, : rest.shape[0]] = rest
            sl = slice(off, off + s.n)
            parts.append(ops.qsa_prefill(q[sl], iq[sl], kc, vc, blocks, s.slot, s.start, **kw))
            off += s.n
        return torch.cat(parts)

    def pool_blocks(self, raw: torch.Tensor, starts: torch.Tensor, w: Indexer) -> torch.Tensor:
        """qsa.pool_blocks: raw [B, r, D] -> mean, RMSNorm, RoPE at each block's start [B]."""
        spec, ops = self.spec, self.ops
        pooled = ops.rms_norm(raw.mean(dim=1), w.k_norm, spec.rms_eps)
        rope = dict(n_rot=spec.n_rot, base=spec.rope_base, neox=True, scale=spec.rope_scale)
        return ops.rope(pooled[:, None].contiguous(), starts.to(torch.int32), **rope)[:, 0]

    # -- Gated DeltaNet ----------------------------------------------------------------------

    def deltanet(self, il: int, w: DeltaNet, h: torch.Tensor, step: Step) -> torch.Tensor:
        hp, ops, eps = self.hp, self.ops, self.spec.rms_eps
        n = h.shape[0]
        qkv = ops.linear(h, w.qkv)  # [N, conv_dim]
        z = ops.linear(h, w.z)  # [N, value_dim]
        beta = rowwise.sigmoid(ops.linear(h, w.beta))  # [N, H_v]
        g = rowwise.softplus(ops.linear(h, w.alpha) + w.dt_bias) * w.a
        heads = dict(
            n_k_heads=hp.ssm_k_heads, n_v_heads=hp.ssm_v_heads, head_dim=hp.ssm_head_dim, eps=eps
        )
        conv, ssm = self.pools.conv[il], self.pools.ssm[il]
        if step.decode:
            y = ops.conv_step(qkv, conv, step.slots, w.conv)
            o = ops.delta_step(y, g, beta, ssm, step.slots, **heads)
        else:
            parts, off = [], 0
            for s in step.spans:
                sl = slice(off, off + s.n)
                parts.append(
                    ops.delta_prefill(
                        qkv[sl], g[sl], beta[sl], conv, ssm, s.slot, w.conv, chunk=DELTA_CHUNK,
                        **heads,
                    )
                )  # fmt: skip
                off += s.n
            o = torch.cat(parts)
        out = ops.gated_norm(o, z, w.norm, eps, w.sigmoid_gate)
        if w.out_order is not None:  # back to the file's value-head order for ssm_out
            out = out.view(n, hp.ssm_v_heads, -1).index_select(1, w.out_order).reshape(n, -1)
        return ops.linear(out, w.out)

    # -- PLE ---------------------------------------------------------------------------------

    def ple(self, w: Ple, x: torch.Tensor, step: Step) -> torch.Tensor:
        """What the PLE layer adds to the streams x [N, hc, d] (reference ple.gated_values and
        ple.dilated_conv); the conv history of each slot advances."""
        qp, ops, eps = self.qp, self.ops, self.spec.rms_eps
        assert qp is not None and qp.ple is not None and step.extra is not None
        n, hc, d = x.shape
        emb = step.extra  # [N, n_heads * head_dim]
        key = ops.rms_norm(ops.linear(emb, w.key).view(n, hc, d), w.norm_key, eps)
        value = ops.linear(emb, w.value)  # [N, d]
        query = ops.rms_norm(x, w.norm_query, eps)
        s = (key * query).sum(dim=-1) / math.sqrt(d)  # [N, hc]
        gate = rowwise.sigmoid(torch.sign(s) * s.abs().clamp_min(1e-6).sqrt())
        gated = gate[:, :, None] * value[:, None, :]  # [N, hc, d]
        conv_in = ops.rms_norm(gated, w.norm_conv, eps).reshape(n, hc * d)
        hist_all = self.pools.ple_conv
        assert hist_all is not None
        dil, k = qp.ple.ngram, w.conv.shape[1]
        if step.decode:
            slots = step.slots.long()
            xp = torch.cat(
                (hist_all.index_select(0, slots), conv_in[:, None]), dim=1
            )  # [B, H+1, C]
            hist = hist_all.shape[1]
            y = torch.zeros_like(conv_in)
            for j in range(k):
                y = y + xp[:, hist - (k - 1 - j) * dil] * w.conv[:, j]
            hist_all.index_copy_(0, slots, xp[:, 1:])
            conv_out = rowwise.silu(y)
        else:
            parts, off = [], 0
            for sp in step.spans:
                out, new = ple_ref.dilated_conv(
                    conv_in[off : off + sp.n], hist_all[sp.slot], w.conv, dil
                )
                hist_all[sp.slot] = new
                parts.append(out)
                off += sp.n
            conv_out = torch.cat(parts)
        return gated + conv_out.view(n, hc, d)
