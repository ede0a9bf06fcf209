"""The QSA family (qwen4exp's block-sparse attention): block ranking and selection, and attention
over the selected blocks' cells, decode and prefill.

Each query scores the complete blocks of its session (pooled block keys, ops/qsa_keys.py) with
its indexer heads, selects the ``budget / ratio`` best, and attends to their cells plus its own
incomplete block (the tail). ``QsaTorch`` equals ``mgserve.core.reference.qsa.select`` +
``qsa.attend_selected`` on the dequantized pools to float rounding. Among equal scores (relu
makes exact zeros common) the lower block wins (``rank_keys``); ``qsa.select(stable=True)``
breaks ties the same way, so the two agree on such selections. Decode is static-shape and
sync-free (a fixed-size selection row per query, masks), so it captures into CUDA graphs;
prefill may synchronise and works in memory-bounded query groups. ``QsaCuda``: qsa_cuda.py.
"""

from __future__ import annotations

import math

import torch

from mgserve.cuda.checks import check_f32, check_index, shape_error
from mgserve.cuda.ops.attention import NEG_INF, check_q
from mgserve.cuda.ops.kv import check_kv, check_span, dequant
from mgserve.cuda.pools import KVLayer

_GATHER_ELEMS = 1 << 26  # bound on gathered K/V + block-score elements per torch QSA group
_KEY_MIN = -(1 << 63)  # rank key of blocks that cannot be selected


def check_qsa(
    iq: torch.Tensor, blocks: torch.Tensor, n: int, n_ctx: int, ratio: int, budget: int
) -> None:
    check_f32("iq", iq)
    check_f32("blocks", blocks)
    if iq.dim() != 3 or iq.shape[0] != n:
        raise shape_error("iq", iq, f"[{n}, H_idx, D_idx]")
    if ratio < 1 or budget < ratio:
        raise ValueError(f"QSA needs ratio >= 1 and budget >= ratio, got {ratio}, {budget}")
    if blocks.dim() != 3 or blocks.shape[1] != n_ctx // ratio or blocks.shape[2] != iq.shape[2]:
        raise shape_error("blocks", blocks, f"[n_slots, {n_ctx // ratio}, {iq.shape[2]}]")


def check_select(scores: torch.Tensor, lengths: torch.Tensor, ratio: int, top: int) -> None:
    check_f32("scores", scores)
    if scores.dim() != 2:
        raise shape_error("scores", scores, "[N, n_cols]")
    check_index("lengths", lengths, scores.shape[0])
    if ratio < 1 or top < 1:
        raise ValueError(f"QSA selection needs ratio >= 1 and top >= 1, got {ratio}, {top}")


def positions(
    sel: torch.Tensor | None,  # [N, top] select_blocks of each query (rows of dense ones unused)
    lengths: torch.Tensor,  # [N] int64: query at lengths - 1
    ratio: int,
    top: int,
    n_ctx: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [N, L] int64, valid [N, L] bool
    """Each query's selection as a fixed number L = top * ratio + ratio - 1 of cells: sparse
    queries (complete blocks > top) take the selected blocks' cells (ascending) then the tail
    complete * ratio .. p; dense ones take 0 .. p (p + 1 <= L always holds for them). Cells past
    the query are invalid. ``sel`` None: every query is dense."""
    dev = lengths.device
    n = lengths.shape[0]
    idx = torch.arange(top * ratio + ratio - 1, device=dev)  # [L]
    last = lengths - 1  # [N]
    dense_valid = idx[None, :] <= last[:, None]
    if sel is None:
        return idx.clamp(max=n_ctx - 1).expand(n, -1), dense_valid
    complete = lengths // ratio
    chosen = sel.long()  # [N, top]
    cells = (chosen[:, :, None] * ratio + torch.arange(ratio, device=dev)).flatten(1)
    tail = complete[:, None] * ratio + torch.arange(ratio - 1, device=dev)  # [N, ratio - 1]
    sparse_pos = torch.cat((cells, tail), dim=1)  # [N, L]
    sparse_valid = torch.cat((torch.ones_like(cells, dtype=torch.bool), tail <= last[:, None]), 1)
    sparse = (complete > top)[:, None]
    pos = torch.where(sparse, sparse_pos, idx[None, :]).clamp(0, n_ctx - 1)
    return pos, torch.where(sparse, sparse_valid, dense_valid)


def attend_cells(
    q: torch.Tensor,  # [N, H, D]
    k: KVLayer,
    v: KVLayer,
    slot_rows: torch.Tensor,  # [N] int64 slot of each query
    pos: torch.Tensor,  # [N, L] int64 selected positions
    valid: torch.Tensor,  # [N, L] bool
    scale: float,
) -> torch.Tensor:  # [N, H * D]
    """Softmax attention of each query over exactly its selected (valid) cells. One query at a
    time: a batched product over the queries may block its reduction by the batch size (CPU
    bmm does), and a query's result must not depend on the other queries of the step."""
    n, h, d = q.shape
    kf = dequant(k, slot_rows[:, None], pos)  # [N, L, Hkv, D]
    vf = dequant(v, slot_rows[:, None], pos)
    n_kv = kf.shape[2]
    qg = q.view(n, n_kv, h // n_kv, d)
    out = q.new_empty(n, n_kv, h // n_kv, d)
    for i in range(n):
        scores = (qg[i] @ kf[i].permute(1, 2, 0)) * scale  # [Hkv, G, L]
        mask = ~valid[i][None, None, :]
        probs = torch.softmax(scores.masked_fill(mask, NEG_INF), dim=-1).masked_fill(mask, 0.0)
        out[i] = probs @ vf[i].permute(1, 0, 2)  # [Hkv, G, D]
    return out.reshape(n, h * d)


def block_scores(iq: torch.Tensor, bl: torch.Tensor) -> torch.Tensor:
    """sum_h relu(iq[., h] . block) / sqrt(D_idx): iq [N, H_idx, D], bl [N, n_blk, D] or
    [n_blk, D] (shared) -> [N, n_blk]."""
    if bl.dim() == 2:
        s = torch.einsum("nhd,kd->nkh", iq, bl)
    else:
        s = torch.einsum("nhd,nkd->nkh", iq, bl)
    return torch.relu(s).sum(dim=-1) / math.sqrt(iq.shape[-1])


def mask_incomplete(scores: torch.Tensor, lengths: torch.Tensor, ratio: int) -> torch.Tensor:
    """-inf at the blocks each query cannot select yet (not complete at its position)."""
    blk = torch.arange(scores.shape[1], device=scores.device)
    return scores.masked_fill(blk[None, :] >= (lengths // ratio)[:, None], NEG_INF)


def rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 [N, n_blk] distinct keys whose order is the selection order: higher score first,
    then the lower block index. Ties are common, not rare: relu makes every block whose indexer
    heads all score negative exactly 0, and torch.topk picks among equal values in an
    implementation-defined way (it depends on the row length and the device), so the choice is
    made explicit here. The high half is the score's float bits made monotone as a signed integer
    (negative scores have their magnitude bits flipped; -0.0 counts as +0.0); no NaN."""
    idx = torch.arange(scores.shape[1], device=scores.device)
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return (bits << 32) | (0xFFFFFFFF - idx)[None, :]


def select_blocks(
    scores: torch.Tensor,  # [N, n_cols] float32 block scores
    lengths: torch.Tensor,  # [N] the query sits at position lengths - 1
    ratio: int,
    top: int,
) -> torch.Tensor:  # [N, top] int32
    """Each query's ``top`` highest-scoring complete blocks (0 .. lengths // ratio - 1, at most
    n_cols; ties: the lower block), in ascending order; a dense query (complete <= top) gets
    0 .. complete - 1 and then -1. Scores past a query's complete blocks are ignored. The torch
    version of ``kernels/qsa_select.cu``: static shapes, no host sync."""
    n_cols = scores.shape[1]
    dev = scores.device
    complete = (lengths.long() // ratio).clamp(0, n_cols)  # [N]
    idx = torch.arange(top, device=dev)
    dense = torch.where(idx[None, :] < complete[:, None], idx[None, :], -1)  # [N, top]
    if n_cols <= top:
        return dense.to(torch.int32)
    blk = torch.arange(n_cols, device=dev)
    keys = rank_keys(scores).masked_fill(blk[None, :] >= complete[:, None], _KEY_MIN)
    chosen = keys.topk(top, dim=1, sorted=False).indices.sort(dim=1).values  # [N, top]
    return torch.where((complete > top)[:, None], chosen, dense).to(torch.int32)


class QsaTorch:
    """QSA in plain PyTorch on the pools' device (static shapes for decode)."""

    def select_blocks(
        self,
        scores: torch.Tensor,  # [N, n_cols] float32 block scores
        lengths: torch.Tensor,  # [N] int32 / int64: query at lengths - 1
        *,
        ratio: int,
        top: int,
    ) -> torch.Tensor:  # [N, top] int32
        """Each query's QSA selection: ``select_blocks`` with checked arguments."""
        check_select(scores, lengths, ratio, top)
        return select_blocks(scores, lengths, ratio, top)

    def decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        iq: torch.Tensor,  # [B, H_idx, D_idx] indexer queries
        k: KVLayer,
        v: KVLayer,
        blocks: torch.Tensor,  # [n_slots, n_ctx / ratio, D_idx] pooled block keys
        slots: torch.Tensor,  # [B] int32
        lengths: torch.Tensor,  # [B] int32
        *,
        ratio: int,
        budget: int,
        scale: float,
    ) -> torch.Tensor:  # [B, H * D]
        """QSA for one query per session: every block score over the fixed-size row (-inf past
        the complete ones), select_blocks, and attention over a fixed number of selected cells."""
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        b, _ = check_q(q, n_kv, d, "B")
        check_qsa(iq, blocks, b, n_ctx, ratio, budget)
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        top, n_blk = budget // ratio, blocks.shape[1]
        lengths_l = lengths.long()
        sel = None
        if n_blk > top:  # otherwise no query can have more than `top` complete blocks
            rows = [
                block_scores(iq[i : i + 1], blocks.index_select(0, slots[i : i + 1].long())[0])
                for i in range(b)
            ]
            sel = self.select_blocks(torch.cat(rows), lengths_l, ratio=ratio, top=top)
        pos, valid = positions(sel, lengths_l, ratio, top, n_ctx)
        return attend_cells(q, k, v, slots.long(), pos, valid, scale)

    def prefill(
        self,
        q: torch.Tensor,  # [T, H, D]
        iq: torch.Tensor,  # [T, H_idx, D_idx]
        k: KVLayer,
        v: KVLayer,
        blocks: torch.Tensor,  # [n_slots, n_ctx / ratio, D_idx]
        slot: int,
        start: int,
        *,
        ratio: int,
        budget: int,
        scale: float,
    ) -> torch.Tensor:  # [T, H * D]
        """QSA for one session's chunk: query j (position start + j) selects among the blocks
        complete at its own position, in groups of queries that bound the gathered K/V."""
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        t, h = check_q(q, n_kv, d, "T")
        check_qsa(iq, blocks, t, n_ctx, ratio, budget)
        check_span(n_ctx, n_slots, slot, start, t)
        top, dev = budget // ratio, q.device
        n_blk = (start + t) // ratio  # blocks complete by the chunk's last query
        per_query = (top * ratio + ratio) * n_kv * d * 2 + n_blk * iq.shape[1]
        group = max(1, min(max(t, 1), _GATHER_ELEMS // per_query))
        bl = blocks[slot, :n_blk]  # [n_blk, D_idx]
        outs = []
        for c0 in range(0, t, group):
            c1 = min(t, c0 + group)
            lengths = torch.arange(start + c0 + 1, start + c1 + 1, device=dev)
            sel = None
            if n_blk > top:
                sel = select_blocks(block_scores(iq[c0:c1], bl), lengths, ratio, top)
            pos, valid = positions(sel, lengths, ratio, top, n_ctx)
            rows = torch.full((c1 - c0,), slot, dtype=torch.long, device=dev)
            outs.append(attend_cells(q[c0:c1], k, v, rows, pos, valid, scale))
        if not outs:
            return q.new_zeros((0, h * d))
        return torch.cat(outs)
