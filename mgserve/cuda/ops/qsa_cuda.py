"""``QsaCuda``: the QSA family on ``kernels/attention_util.cu`` (block scores),
``kernels/qsa_select.cu`` (each query's top blocks, ascending: a radix select in one CTA per query,
or for a decode step's few rows in a cluster of SEL_CLUSTER CTAs per query on sm_90)
and the attention family's decode kernel (``AttentionCuda.run_decode`` over the selected blocks'
cells and the tail).

Decode: score the complete blocks (kernel), select (kernel), attend (kernel): no host sync, so it
captures into a CUDA graph. Prefill scores all the chunk's queries against the complete blocks
with one fp32 matmul (cuBLAS; in query groups bounding the score matrix), sums the heads' relus
and selects with kernels (``qsa_prefill.py``), then attends: queries before QSA_FLASH_MAX_POS
with the flash prefill kernel over all earlier positions masked to their selection
(``visibility_kernel``), later ones with the decode kernel over their selected cells ("virtual
sessions", ``AttentionCuda.run_virtual``). Pools or indexer shapes the kernels do not cover go to
the torch version.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mgserve.cuda.checks import as_i32, check_index, on_device
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.attention import check_q
from mgserve.cuda.ops.attention_cuda import AttentionCuda
from mgserve.cuda.ops.attention_prefill import cdiv, visibility, visibility_kernel
from mgserve.cuda.ops.kv import check_kv, check_span
from mgserve.cuda.ops.qsa import QsaTorch, check_qsa, check_select
from mgserve.cuda.ops.qsa_prefill import QSA_SCORE_GROUP, prefill_select
from mgserve.cuda.pools import KVLayer

UTIL_SOURCE = "attention_util.cu"
SELECT_SOURCE = "qsa_select.cu"
SEL_THREADS = 1024  # SEL_THREADS in qsa_select.cu: one CTA per query row
SEL_CLUSTER = 8  # SEL_CLUSTER in qsa_select.cu: qsa_select_c's CTAs a row (a cluster)
# rows up to which select takes qsa_select_c: a decode step's few sessions (8 rows are 64 CTAs
# of 1024 threads, an SM each; more rows would queue clusters behind each other)
SEL_CLUSTER_ROWS = 8
QS_THREADS = 256  # QS_THREADS in attention_util.cu
QS_KEYS = 256  # QS_KEYS in attention_util.cu: block keys scored per CTA
QS_MAX_HI, QS_MAX_DI = 8, 256  # indexer heads / head dim the scoring kernel supports
QSA_MIN_CHUNK = 64  # QSA decode: ~2k selected cells per query, so smaller chunks for more CTAs
QSA_PREFILL_MIN_CHUNK = 1088  # QSA prefill: a selection's ~2k cells in two chunks per query
# Prompt queries at positions below this run attn_prefill over every earlier position, masked to
# their selection (work ~ position, on tensor cores); later ones the decode kernel over their
# ~top * ratio cells. A function of the position alone (batch invariance); the break-even is an
# estimate (~8k positions at qwen4exp's 2048-cell budget), to be measured.
QSA_FLASH_MAX_POS = 8192


class QsaCuda:
    """QSA on the scoring, selection and attention kernels (see the module docstring).
    ``decode`` and ``prefill`` share their keyword arguments and first checks with QsaTorch's
    (the family's interface); what follows differs (per-session rows vs one span)."""

    def __init__(self, kernels: Kernels, fallback: QsaTorch, attention: AttentionCuda) -> None:
        self.kernels, self.fallback, self.attention = kernels, fallback, attention
        self.device = kernels.device
        self.prefill_kernels = True  # False: the prompt's head sums and visibility in torch ops
        # prompt queries a selection score product takes (qsa_prefill.py: one shape for all;
        # three launches a group): bench model --paired R --toggle qsa.score_group=64/256
        self.score_group = QSA_SCORE_GROUP
        # a decode step's selections on thread block clusters (qsa_select_c: a row's tiles over
        # SEL_CLUSTER CTAs; the same output), where the GPU has them (Kernels.clusters): one
        # session at 250000 +1.2% on the H100 (bench model --paired 5 --toggle qsa.cluster,
        # 2026-12-07); off in a green context's process (green.py)
        self.cluster = kernels.clusters

    # -- kernels ---------------------------------------------------------------------------------

    def scores(
        self,
        iq: torch.Tensor,  # [N, H_idx, D_idx] contiguous
        blocks: torch.Tensor,  # [n_slots, n_blk, D_idx] contiguous
        slots: torch.Tensor,  # [N] int32
        lengths: torch.Tensor,  # [N] int32
        n_cols: int,  # blocks scored per row (complete blocks of any query fit)
        ratio: int,
        top: int,
    ) -> torch.Tensor:  # [N, stride] float32 (-inf past complete and on dense rows)
        """Block scores of the complete blocks of sparse queries (kernel); rows padded to a
        multiple of 4 floats for qsa_select's 16-byte loads (the padding is not written)."""
        n, n_hi, di = iq.shape
        stride = cdiv(n_cols, 4) * 4
        scores = torch.empty((n, stride), dtype=torch.float32, device=self.device)
        self.kernels.launch(
            self.kernels.kernel(UTIL_SOURCE, "qsa_scores"),
            (cdiv(n_cols, QS_KEYS), n),
            QS_THREADS,
            iq.data_ptr(),
            blocks.data_ptr(),
            slots.data_ptr(),
            lengths.data_ptr(),
            scores.data_ptr(),
            np.int32(n_cols),
            np.int32(stride),
            np.int32(blocks.shape[1]),
            np.int32(n_hi),
            np.int32(di),
            np.int32(ratio),
            np.int32(top),
            np.float32(math.sqrt(di)),
        )
        return scores

    def select(
        self,
        scores: torch.Tensor,  # [N, stride] float32, stride % 4 == 0, contiguous
        lengths: torch.Tensor,  # [N] int32
        n_cols: int,  # columns that may hold complete blocks (<= stride)
        ratio: int,
        top: int,
        out: torch.Tensor | None = None,  # [N, top] int32 contiguous
    ) -> torch.Tensor:  # [N, top] int32: select_blocks of each row (kernel)
        n, stride = scores.shape
        assert stride % 4 == 0 and n_cols <= stride and scores.is_contiguous()
        sel = torch.empty((n, top), dtype=torch.int32, device=self.device) if out is None else out
        if n:
            clustered = self.cluster and self.kernels.clusters and n <= SEL_CLUSTER_ROWS
            self.kernels.launch(
                self.kernels.kernel(SELECT_SOURCE, "qsa_select_c" if clustered else "qsa_select"),
                n,  # rows: CTAs, or clusters of SEL_CLUSTER
                SEL_THREADS,
                scores.data_ptr(),
                lengths.data_ptr(),
                sel.data_ptr(),
                np.int32(stride),
                np.int32(n_cols),
                np.int32(ratio),
                np.int32(top),
                cluster=SEL_CLUSTER if clustered else None,
            )
        return sel

    def score_and_select(
        self,
        iq: torch.Tensor,
        blocks: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        n_cols: int,
        ratio: int,
        top: int,
    ) -> torch.Tensor:  # [N, top] int32 ascending selected blocks (dense rows: 0.. then -1)
        """Block scores, then each row's top blocks in ascending order (two kernels: no host
        sync, graph-capturable)."""
        scores = self.scores(iq, blocks, slots, lengths, n_cols, ratio, top)
        return self.select(scores, lengths, n_cols, ratio, top)

    def _visibility(self, sel: torch.Tensor, start: int, ratio: int, top: int) -> torch.Tensor:
        if self.prefill_kernels:
            return visibility_kernel(self.kernels, sel, start, ratio, top)
        return visibility(sel, start, ratio, top)  # the torch ops the kernel replaced

    def _covers(
        self, q: torch.Tensor, iq: torch.Tensor, k: KVLayer, v: KVLayer, blocks: torch.Tensor
    ) -> bool:
        n_hi, di = iq.shape[1], iq.shape[2]
        return (
            self.attention.covers(q, k, v)
            and n_hi <= QS_MAX_HI
            and di <= QS_MAX_DI
            and di % 32 == 0
            and blocks.is_contiguous()
            and on_device(self.device, iq, blocks)
        )

    # -- ops -------------------------------------------------------------------------------------

    def select_blocks(
        self, scores: torch.Tensor, lengths: torch.Tensor, *, ratio: int, top: int
    ) -> torch.Tensor:
        check_select(scores, lengths, ratio, top)
        if not on_device(self.device, scores, lengths):
            return self.fallback.select_blocks(scores, lengths, ratio=ratio, top=top)
        n, n_cols = scores.shape
        stride = cdiv(n_cols, 4) * 4
        if stride != n_cols or not scores.is_contiguous() or scores.data_ptr() % 16:
            padded = torch.empty((n, stride), dtype=torch.float32, device=self.device)
            padded[:, :n_cols] = scores
            scores = padded
        return self.select(scores, as_i32("lengths", lengths, self.device), n_cols, ratio, top)

    def decode(
        self,
        q: torch.Tensor,
        iq: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        blocks: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        *,
        ratio: int,
        budget: int,
        scale: float,
    ) -> torch.Tensor:
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        b, _ = check_q(q, n_kv, d, "B")
        check_qsa(iq, blocks, b, n_ctx, ratio, budget)
        if not self._covers(q, iq, k, v, blocks):
            return self.fallback.decode(
                q, iq, k, v, blocks, slots, lengths, ratio=ratio, budget=budget, scale=scale
            )
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        slots = as_i32("slots", slots, self.device)
        lengths = as_i32("lengths", lengths, self.device)
        top, n_blk, qc = budget // ratio, blocks.shape[1], q.contiguous()
        if n_blk <= top:  # no session can have more than `top` complete blocks: dense
            return self.attention.run_decode(
                qc, k, v, slots, lengths, None, scale=scale, bound=n_ctx
            )
        sel = self.score_and_select(iq.contiguous(), blocks, slots, lengths, n_blk, ratio, top)
        bound = min(n_ctx, top * ratio + ratio - 1)
        return self.attention.run_decode(
            qc, k, v, slots, lengths, sel, scale=scale, bound=bound, min_chunk=QSA_MIN_CHUNK,
            top=top, ratio=ratio,
        )  # fmt: skip

    def prefill(
        self,
        q: torch.Tensor,
        iq: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        blocks: torch.Tensor,
        slot: int,
        start: int,
        *,
        ratio: int,
        budget: int,
        scale: float,
    ) -> torch.Tensor:
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        t, h = check_q(q, n_kv, d, "T")
        check_qsa(iq, blocks, t, n_ctx, ratio, budget)
        check_span(n_ctx, n_slots, slot, start, t)
        if not self._covers(q, iq, k, v, blocks):
            return self.fallback.prefill(
                q, iq, k, v, blocks, slot, start, ratio=ratio, budget=budget, scale=scale
            )
        top, end = budget // ratio, start + t
        n_blk = end // ratio  # blocks complete by the chunk's last query
        if t == 0:
            return q.new_zeros((0, h * d))
        qc, sel = q.contiguous(), None
        if n_blk > top:  # otherwise every query of the chunk is dense
            lengths = torch.arange(start + 1, end + 1, dtype=torch.int32, device=self.device)
            sel = prefill_select(self, iq, blocks, slot, lengths, n_blk, ratio, top)
        limit = QSA_FLASH_MAX_POS if self.attention.flash_prefill else 0
        split = min(t, max(0, limit - start))  # queries 0 .. split - 1 on attn_prefill
        outs = []
        if split:
            vis = None if sel is None else self._visibility(sel[:split], start, ratio, top)
            outs.append(
                self.attention.flash.run(qc[:split], k, v, slot, start, scale=scale, vis=vis)
            )
        if split < t:
            rest = qc[split:]
            if sel is None:
                outs.append(self.attention.run_virtual(
                    rest, k, v, slot, start + split, None, scale=scale, bound=end,
                    min_chunk=QSA_PREFILL_MIN_CHUNK,
                ))  # fmt: skip
            else:
                outs.append(self.attention.run_virtual(
                    rest, k, v, slot, start + split, sel[split:], scale=scale,
                    bound=min(end, top * ratio + ratio - 1), min_chunk=QSA_PREFILL_MIN_CHUNK,
                    top=top, ratio=ratio,
                ))  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs)
