"""qwen4exp on the device backend: qwen3next's layers (hybrid.py) on hyper-connection streams
[N, hc, d] (mix / combine in place of the norms), QSA block-sparse attention on the full-attention
layers with an indexer, and the PLE n-gram embedding on one layer (the twin of
core/models/qwen4exp.py).

Decode reads only [B]-shaped device inputs: QSA's block keys are pooled on the device as blocks
complete (``backend.qsa_keys``); PLE rows are hashed and gathered on the host and handed over as
``Step.extra`` (``step_extra``, which advances each slot's token history). The QSA pending keys
and the PLE conv take the step's runs (``Step.chains``) and log their re-runs (``Step.log``) as
the DeltaNet layers do (models/deltanet.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from mgserve.core.gguf.hparams_qwen4exp import qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.reference import ple as ple_ref
from mgserve.core.reference import ple_rows
from mgserve.cuda.loader import Loader
from mgserve.cuda.models.base import Step, key_lengths, loaded
from mgserve.cuda.models.hybrid import HybridLM, Layer
from mgserve.cuda.models.moe import load_moe, moe_ffn
from mgserve.cuda.models.qwen4exp_weights import HC, Indexer, Ple, load_hc, load_indexer, load_ple
from mgserve.cuda.ops.chains import Chains
from mgserve.cuda.ops.linear_tuning import Q8Activations
from mgserve.cuda.pools import KVLayer

Pending = tuple[torch.Tensor, torch.Tensor] | None  # a block output and inject not yet added


class Qwen4ExpLM(HybridLM):
    def read_extras(self, g: GGUFFile) -> None:
        self.qp = qp = qwen4exp_spec_from_gguf(g, self.hp.recurrent, self.spec.n_rot)
        self.ple_table = None
        if qp.ple is not None:
            self.ple_table = g.tensor("per_layer_token_embd.weight")  # stays memory-mapped
            ple_ref.check_table(self.ple_table, qp.ple, g.path)
            ple_rows.advise_random(self.ple_table)
            self.decode_extra_shape = (qp.ple.n_heads * qp.ple.head_dim,)
        self.handoff_shape = (qp.hc, self.spec.n_embd)  # the residual streams
        # the last ngram - 1 tokens of each slot, for the host-side n-gram hash
        self._ple_tokens: dict[int, np.ndarray] = {}

    def add_pools(self) -> None:
        qp, pools = self.qp, self.pools
        for il, layer in self.layers.items():
            if layer.indexer is not None:
                pools.add_qsa(il, qp.ratio, qp.idx_dim, self.device)
        if qp.ple is not None and qp.ple.layer in self.layers:
            hc_dim = qp.hc * self.spec.n_embd
            pools.ple_conv = torch.zeros(pools.n_slots, qp.ple.history, hc_dim, device=self.device)

    # -- loading -----------------------------------------------------------------------------

    output_hc: HC | None = None  # the last stage's (load_head)

    def load_head(self, ld: Loader) -> None:
        self.output_hc = load_hc(ld, "output_hc", self.spec.n_embd, self.qp, inject=False)

    def load_layer(self, ld: Loader, il: int) -> Layer:
        qp, d, p = self.qp, self.spec.n_embd, f"blk.{il}."
        return Layer(
            mixer=self.load_mixer(ld, il),
            moe=load_moe(ld, il, d, self.hp),
            hc_attn=load_hc(ld, p + "hc_attn", d, qp, inject=True),
            hc_ffn=load_hc(ld, p + "hc_ffn", d, qp, inject=True),
            indexer=load_indexer(ld, il, d, qp) if qp.compress[il] else None,
            ple=load_ple(ld, il, d, qp) if qp.ple is not None and qp.ple.layer == il else None,
        )

    # -- sessions ----------------------------------------------------------------------------

    def begin_sequence(self, slot: int) -> None:
        super().begin_sequence(slot)
        if self.qp.ple is not None:
            p = self.qp.ple
            self._ple_tokens[slot] = np.full(p.ngram - 1, p.eos, dtype=np.int64)

    def host_state(self, slot: int) -> np.ndarray | None:
        hist = self._ple_tokens.get(slot)
        return None if hist is None else hist.copy()

    def set_host_state(self, slot: int, state: np.ndarray | None) -> None:
        if state is not None:
            self._ple_tokens[slot] = state.copy()

    def step_extra(
        self, step_tokens: list[list[int]], slots: list[int], packed: bool = False
    ) -> torch.Tensor | None:
        """The PLE rows of the step's tokens [N, n_heads * head_dim] (host float32), hashed with
        each slot's token history, which this advances. ``packed``: the rows as the table stores
        them where ``ple`` can decode them on the device (``ple_rows.packed_rows``: a prompt
        chunk's host work and copy shrink to a gather of bytes)."""
        if self.ple_table is None:
            return None
        assert self.qp.ple is not None
        p = self.qp.ple
        for slot in slots:
            if slot not in self._ple_tokens:
                self._ple_tokens[slot] = np.full(p.ngram - 1, p.eos, dtype=np.int64)
        if len(set(slots)) == len(slots) and all(len(t) == 1 for t in step_tokens):
            # a decode step (no drafts: a slot's rows would chain): every session at once
            hists = np.stack([self._ple_tokens[slot] for slot in slots])  # [S, ngram - 1]
            last = np.array([t[0] for t in step_tokens], dtype=np.int64)
            ctx = ple_ref.decode_contexts(last, hists, p)
            new = np.concatenate((hists, last[:, None]), axis=1)[:, 1:]  # each history on
            for slot, hist in zip(slots, new, strict=True):
                self._ple_tokens[slot] = hist
        else:
            contexts = []
            for toks, slot in zip(step_tokens, slots, strict=True):
                hist = self._ple_tokens[slot]
                t = np.asarray(toks, dtype=np.int64)
                contexts.append(ple_ref.ngram_contexts(t, hist, p))
                seq = np.concatenate((hist, t))
                self._ple_tokens[slot] = seq[seq.size - hist.size :]
            ctx = np.concatenate(contexts, axis=1)
        rows = ple_ref.hash_contexts(ctx, p)  # one hash a step
        packed = packed and self.backend.ple.packed_rows
        raw = ple_rows.packed_rows(self.ple_table, rows) if packed else None
        return raw if raw is not None else ple_rows.gather_rows(self.ple_table, rows).flatten(1)

    # -- the forward -------------------------------------------------------------------------

    def stage_layers(self, x: torch.Tensor, step: Step, start: int, stop: int) -> torch.Tensor:
        """As HybridLM's, except that each block's output is added to the streams by the next
        mix (``hc.combine_mix``: one kernel and one pass over the streams fewer per block); the
        last one's is added at the end, so a stage hands off the settled streams [N, hc, d]
        (combine then mix is bitwise combine_mix: both round the combine the same way)."""
        pending: Pending = None
        for il in range(start, stop):
            x, pending = self.block_pending(il, x, step, pending)
            step.layer_done()
        return self.settle(x, pending)

    def settle(self, x: torch.Tensor, pending: Pending) -> torch.Tensor:
        """The streams with the pending block output added."""
        return x if pending is None else self.backend.hc.combine(x, *pending)

    def embed(self, step: Step) -> torch.Tensor:
        table = loaded(self.tok_embd, "the token embedding")
        return self.backend.embed.gather(table, step.tokens, streams=self.qp.hc)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x, loaded(self.output_hc, "the head"))[0]

    def mix(self, x: torch.Tensor, w: HC) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a block reads from the streams [N, d], and its inject weights [N, hc]."""
        return self.backend.hc.mix(x, w.norm, w.down, w.up, w.inject, self.spec.rms_eps)

    def mix_pending(
        self, x: torch.Tensor, pending: Pending, w: HC
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(streams with the pending output added, what the block reads, its inject weights)."""
        if pending is None:
            h, inject = self.mix(x, w)
        else:
            x, h, inject = self.backend.hc.combine_mix(
                x, *pending, w.norm, w.down, w.up, w.inject, self.spec.rms_eps
            )
        assert inject is not None
        return x, h, inject

    def block_pending(
        self, il: int, x: torch.Tensor, step: Step, pending: Pending
    ) -> tuple[torch.Tensor, Pending]:
        """One layer on the streams x with ``pending`` (the previous block's output and inject,
        not yet added): (x, this layer's pending FFN output)."""
        layer = self.layers[il]
        assert layer.hc_attn is not None and layer.hc_ffn is not None
        if layer.ple is not None:
            x = self.settle(x, pending)
            x, pending = x + self.ple(layer.ple, x, step), None
        x, h, inject = self.mix_pending(x, pending, layer.hc_attn)
        x, h, inject = self.mix_pending(x, (self.mixer(il, layer, h, step), inject), layer.hc_ffn)
        return x, (moe_ffn(self.backend, layer.moe, h, self.hp), inject)

    def attend(self, il: int, layer: Layer, q: torch.Tensor, kc: KVLayer, vc: KVLayer,
               h: torch.Tensor, step: Step, xq: Q8Activations | None) -> torch.Tensor:  # fmt: skip
        if layer.indexer is None:
            return super().attend(il, layer, q, kc, vc, h, step, xq)
        return self.sparse(il, layer.indexer, q, kc, vc, h, step, xq)

    def sparse(self, il: int, w: Indexer, q: torch.Tensor, kc: KVLayer, vc: KVLayer,
               h: torch.Tensor, step: Step, xq: Q8Activations | None) -> torch.Tensor:  # fmt: skip
        """Pool the blocks this step completes, then QSA attention over the selected cells."""
        spec, b, qp = self.spec, self.backend, self.qp
        n, eps = h.shape[0], spec.rms_eps
        iq = b.linear.matmul(h, w.q_proj, xq=xq).view(n, qp.idx_heads, qp.idx_dim)
        iq = self.rotate(iq, w.q_norm, step.pos)
        raw = b.linear.matmul(h, w.k_proj, xq=xq)  # [N, D]
        blocks, pending = self.pools.blocks[il], self.pools.pending[il]
        n_rot, base, rope_scale = spec.n_rot, spec.rope_base, spec.rope_scale
        ratio, budget, scale = qp.ratio, qp.idx_budget, spec.attn_scale
        if step.decode:
            write = partial(
                b.qsa_keys.write_decode, pending=pending, blocks=blocks, k_norm=w.k_norm, eps=eps,
                n_rot=n_rot, base=base, scale=rope_scale,
            )  # fmt: skip
            write(raw=raw, slots=step.slots, pos=step.pos, chains=step.chains)
            if step.log is not None:
                step.log.append(partial(_replay_keys, write, raw, step.pos))
            return b.qsa.decode(
                q, iq, kc, vc, blocks, step.slots, key_lengths(step), ratio=ratio, budget=budget,
                scale=scale,
            )  # fmt: skip
        parts, off = [], 0
        for s in step.spans:
            sl = slice(off, off + s.n)
            b.qsa_keys.write_span(
                raw[sl], pending, blocks, s.slot, s.start, w.k_norm, eps, n_rot=n_rot, base=base,
                scale=rope_scale,
            )  # fmt: skip
            parts.append(
                b.qsa.prefill(
                    q[sl], iq[sl], kc, vc, blocks, s.slot, s.start, ratio=ratio, budget=budget,
                    scale=scale,
                )
            )  # fmt: skip
            off += s.n
        return torch.cat(parts)

    def ple(self, w: Ple, x: torch.Tensor, step: Step) -> torch.Tensor:
        """What the PLE layer adds to the streams x [N, hc, d]; each slot's conv history
        advances."""
        assert self.qp.ple is not None and step.extra is not None
        b, dilation, hist = self.backend, self.qp.ple.ngram, self.pools.ple_conv
        assert hist is not None
        n, hc, d = x.shape
        emb = step.extra  # [N, n_heads * head_dim] float32, or the packed rows (step_extra)
        if emb.dtype == torch.uint8:
            assert self.ple_table is not None
            emb = ple_rows.unpack_rows(emb, self.ple_table.type_name)
        gated, conv_in = b.ple.gated(
            x, emb, w.key, w.value, w.norm_key, w.norm_query, w.norm_conv, self.spec.rms_eps
        )
        if step.decode:
            conv = partial(b.ple.conv_decode, history=hist, weight=w.conv, dilation=dilation)
            conv_out = conv(conv_in, slots=step.slots, chains=step.chains)
            if step.log is not None:
                step.log.append(partial(_replay_ple, conv, conv_in))
        else:
            parts, off = [], 0
            for s in step.spans:
                x_s = conv_in[off : off + s.n]
                parts.append(b.ple.conv_prefill(x_s, hist, s.slot, w.conv, dilation))
                off += s.n
            conv_out = torch.cat(parts)
        return gated + conv_out.view(n, hc, d)


def _replay_keys(write: Any, raw: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                 slots: torch.Tensor, chains: Chains) -> None:  # fmt: skip
    """A decode step's QSA key writes again, on the logged keys of ``rows`` (a ``Replay``)."""
    write(raw=raw.index_select(0, rows), slots=slots, pos=pos.index_select(0, rows), chains=chains)


def _replay_ple(conv: Any, conv_in: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                chains: Chains) -> None:  # fmt: skip
    """A decode step's PLE conv again, on the logged inputs of ``rows`` (a ``Replay``)."""
    conv(conv_in.index_select(0, rows), slots=slots, chains=chains)
