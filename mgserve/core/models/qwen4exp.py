"""qwen4exp (Qwen3.8-Flash-Next): qwen3next's layers (Gated DeltaNet with a sigmoid output gate,
gated full attention, routed + shared MoE) on a hyper-connection residual, with QSA block-sparse
attention on the full-attention layers and the PLE n-gram hash embedding on one DeltaNet layer
(src/models/qwen4exp.cpp; HF ``Qwen4ExpForCausalLM``).

Residual: ``hc`` streams per token, [N, hc, d], starting as copies of the embedding. Block::

    x += ple(x)                                       (PLE layer only)
    h, w = hc_mix(x, hc_attn);  x += w * mixer(h)     (DeltaNet or QSA attention)
    h, w = hc_mix(x, hc_ffn);   x += w * moe(h)
Head: logits = output(hc_mix(x, output_hc)) (no output norm).

Sessions keep a ``Qwen4ExpState``. Token-wise work runs on all sessions' tokens at once; the conv
histories, the recurrences, the block keys and the sparse attention run per session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.hparams_qwen4exp import qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.base import SeqInput
from mgserve.core.models.hybrid_weights import load_attn, load_moe
from mgserve.core.models.kvcache import KVCache
from mgserve.core.models.qwen3next import Qwen3Next
from mgserve.core.models.qwen4exp_weights import load_deltanet, load_hc, load_indexer, load_ple
from mgserve.core.models.state_qwen4exp import Qwen4ExpState
from mgserve.core.reference import gated_attention, moe, ops, ple, ple_rows, qsa
from mgserve.core.reference import hyper_connections as hc
from mgserve.core.reference.deltanet import DeltaNetWeights
from mgserve.core.reference.gated_attention import AttnWeights
from mgserve.core.reference.hyper_connections import HCWeights
from mgserve.core.reference.moe import MoeWeights
from mgserve.core.reference.ple import PleWeights
from mgserve.core.reference.qsa import IndexerWeights

PLE_TABLE = "per_layer_token_embd.weight"


@dataclass
class Qwen4ExpLayer:
    hc_attn: HCWeights
    mixer: DeltaNetWeights | AttnWeights
    hc_ffn: HCWeights
    moe: MoeWeights
    indexer: IndexerWeights | None = None  # QSA layers
    ple: PleWeights | None = None  # the PLE layer


def _state(s: SeqInput) -> Qwen4ExpState:
    if not isinstance(s.cache, Qwen4ExpState):
        raise ValueError("qwen4exp sessions need the Qwen4ExpState from new_cache()")
    return s.cache


class Qwen4Exp(Qwen3Next):
    def __init__(self, g: GGUFFile, spec: ModelSpec, hybrid: HybridSpec) -> None:
        self.qp = qwen4exp_spec_from_gguf(g, hybrid.recurrent, spec.n_rot)
        if self.qp.ple is not None:
            # Stays memory-mapped: each forward reads only the rows its tokens hash to.
            self.ple_table = g.tensor(PLE_TABLE)
            ple.check_table(self.ple_table, self.qp.ple, g.path)
            ple_rows.advise_random(self.ple_table)
        super().__init__(g, spec, hybrid)

    def load_head(self, g: GGUFFile) -> None:
        self.output_hc = load_hc(g, "output_hc", self.spec.n_embd, self.qp, inject=False)

    def load_layer(self, g: GGUFFile, il: int) -> Qwen4ExpLayer:  # type: ignore[override]
        spec, hp, qp, d = self.spec, self.hybrid, self.qp, self.spec.n_embd
        rec = hp.recurrent[il]
        return Qwen4ExpLayer(
            hc_attn=load_hc(g, f"blk.{il}.hc_attn", d, qp, inject=True),
            mixer=load_deltanet(g, il, spec, hp) if rec else load_attn(g, il, spec, hp),
            hc_ffn=load_hc(g, f"blk.{il}.hc_ffn", d, qp, inject=True),
            moe=load_moe(g, il, spec, hp),
            indexer=load_indexer(g, il, spec, qp) if qp.compress[il] else None,
            ple=load_ple(g, il, spec, qp) if qp.ple and qp.ple.layer == il else None,
        )

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache:
        return cast(KVCache, Qwen4ExpState(self.spec, self.hybrid, self.qp, n_ctx, type_k, type_v))

    def begin(self, seqs: Sequence[SeqInput]) -> None:
        for s in seqs:
            _state(s)
        super().begin(seqs)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embd[tokens]  # [N, d]
        return x[:, None, :].repeat(1, self.qp.hc, 1)  # [N, hc, d]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        mixed, _ = hc.mix(x, self.output_hc, self.spec.rms_eps)  # [R, d]
        return ops.linear(mixed, self.output)

    def block(
        self, il: int, x: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:  # [N, hc, d]
        layer, eps, hp = self.layers[il], self.spec.rms_eps, self.hybrid
        if layer.ple is not None:
            x = x + self.ple_residual(layer.ple, x, seqs)
        h, inject = hc.mix(x, layer.hc_attn, eps)
        if isinstance(layer.mixer, DeltaNetWeights):
            out = self.linear_attention(il, layer.mixer, h, seqs)
        else:
            out = self.attention(il, layer, h, pos, seqs)
        assert inject is not None
        x = hc.combine(x, out, inject)
        h, inject = hc.mix(x, layer.hc_ffn, eps)
        assert inject is not None
        return hc.combine(x, moe.moe_ffn(h, layer.moe, hp.n_expert_used, hp.norm_topk), inject)

    def ple_residual(
        self, w: PleWeights, x: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:  # [N, hc, d]
        """What the PLE layer adds to the streams; advances each session's hash and conv history."""
        p = self.qp.ple
        assert p is not None
        rows = []
        for s in seqs:  # hashing is host work on token ids, per session
            st, toks = _state(s), s.tokens.numpy()
            rows.append(ple.ngram_rows(toks, st.ple_tokens.numpy(), p))
            history = torch.cat((st.ple_tokens, s.tokens))
            st.ple_tokens.copy_(history[history.numel() - st.ple_tokens.numel() :])
        emb = ple_rows.gather_rows(self.ple_table, np.concatenate(rows))  # [N, n_heads, head_dim]
        gated, conv_in = ple.gated_values(x, emb.flatten(1), w, self.spec.rms_eps)
        conv_out, off = torch.empty_like(conv_in), 0  # [N, hc * d]
        for s in seqs:
            st, t = _state(s), s.tokens.numel()
            conv_out[off : off + t], st.ple_conv[:] = ple.dilated_conv(
                conv_in[off : off + t], st.ple_conv, w.conv, p.ngram
            )
            off += t
        return gated + conv_out.view(x.shape)

    def attention(
        self,
        il: int,
        layer: Qwen4ExpLayer,
        h: torch.Tensor,
        pos: torch.Tensor,
        seqs: Sequence[SeqInput],
    ) -> torch.Tensor:  # [N, d]
        """Gated attention; on QSA layers each query attends to its selected blocks and tail."""
        spec, w = self.spec, layer.mixer
        assert isinstance(w, AttnWeights)
        q, k, v, gate = gated_attention.project(w, h, pos, spec)
        if layer.indexer is not None:
            iq, raw = qsa.index_queries(h, pos, layer.indexer, spec)
        outs, off = [], 0
        for s in seqs:
            st, t = _state(s), s.tokens.numel()
            rows = slice(off, off + t)
            kv = st.kv_index[il]
            st.kv.write(kv, s.start, k[rows], v[rows])
            keys, values = st.kv.read(kv, s.start + t)  # [start + t, Hkv, Dh]
            if layer.indexer is None:
                outs.append(ops.attention(q[rows], keys, values, pos[rows], scale=spec.attn_scale))
            else:
                blocks = self.update_blocks(il, layer.indexer, st, s.start, raw[rows])
                outs.append(self.sparse(q[rows], iq[rows], s.start, blocks, keys, values))
            off += t
        return gated_attention.output(torch.cat(outs), gate, w)

    def sparse(
        self,
        q: torch.Tensor,  # [T, H, Dh] one session's queries
        iq: torch.Tensor,  # [T, H_idx, D] their indexer queries
        start: int,  # position of q[0]
        blocks: torch.Tensor,  # [n_ctx / r, D] the session's block keys
        keys: torch.Tensor,  # [start + T, Hkv, Dh]
        values: torch.Tensor,
    ) -> torch.Tensor:  # [T, H * Dh]
        """QSA per query: select blocks, then attend to exactly the selected rows. One query at a
        time, so a query's result does not depend on the chunk it came in."""
        qp, scale = self.qp, self.spec.attn_scale
        outs = []
        for j in range(q.shape[0]):
            sel = qsa.select(iq[j], start + j, blocks, qp.ratio, qp.idx_budget)  # [S']
            outs.append(qsa.attend_selected(q[j], keys[sel], values[sel], scale))
        return torch.stack(outs)

    def update_blocks(
        self, il: int, w: IndexerWeights, st: Qwen4ExpState, start: int, raw: torch.Tensor
    ) -> torch.Tensor:  # [n_ctx / r, D] the session's block keys for this layer
        """Pool the blocks this chunk (raw keys [T, D] from ``start``) completes; keep the rest."""
        i, r = st.qsa_index[il], self.qp.ratio
        buf = torch.cat((st.pending[i, : start % r], raw))  # [start % r + T, D]
        first, n_new = start // r, buf.shape[0] // r
        if n_new:
            whole = buf[: n_new * r].view(n_new, r, -1)
            st.blocks[i, first : first + n_new] = qsa.pool_blocks(whole, first, w, self.spec)
        rest = buf[n_new * r :]
        st.pending[i, : rest.shape[0]] = rest
        return st.blocks[i]
