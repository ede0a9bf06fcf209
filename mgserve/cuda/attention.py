"""The attention op family of the device backend: K/V pool writes and reads, dense and
sliding-window attention (decode and prefill), and QSA block-sparse attention (qwen4exp).

K and V live in slot pools (``KVLayer``: [n_slots, n_ctx, n_kv, D] values, plus f16 scales per 32
values for q8_0). Index tensors (slots, positions, lengths) are int32 on the device. A decode
query of session b sits at position ``lengths[b] - 1`` and sees positions ``0 .. lengths[b] - 1``
of slot ``slots[b]`` (the last ``window`` of them for sliding-window layers); query head h reads
KV head ``h // (H / n_kv)``. A session with length 0 (a padding row) gets zeros.

``AttentionTorch`` is the oracle-equivalent PyTorch version: it equals
``mgserve.core.reference.ops.attention`` / ``qsa.select`` + ``qsa.attend_selected`` on the
dequantized cache to float rounding. QSA picks the highest block scores and, among equal scores
(relu makes exact zeros common), the lower block (``select_blocks``); ``qsa.select`` must break
ties the same way (a stable descending sort) for the two to agree on such selections. The decode
ops are static-shape and sync-free (masks over all ``n_ctx`` positions, a fixed-size QSA
selection), so they capture into CUDA graphs; the prefill ops may synchronise and work in
memory-bounded chunks.

``AttentionCuda`` runs ``kernels/attention.cu`` (flash-decoding with tensor cores: one CTA per
(chunk of positions, KV head, session) holding all query heads of the group, so K/V are read once;
a combine kernel merges the chunks in a fixed order, so results never depend on the batch) and
``kernels/attention_util.cu`` (pool writes, QSA block scores) and ``kernels/qsa_select.cu`` (each
query's top blocks, ascending: a radix select in one CTA per query). QSA decode is: score the
complete blocks (kernel), select (kernel), then the same attention kernel reading the selected
blocks' cells and the tail. Prefill: short chunks (<= PREFILL_DECODE_MAX_T tokens, e.g.
speculative verification) run the decode kernel once per token ("virtual sessions", exactly a
decode step's numerics); longer dense chunks use torch's flash SDPA on f16 copies of K/V (about
1e-3 relative, like llama.cpp). QSA prefill scores all the chunk's queries against the complete
blocks with one fp32 matmul (cuBLAS; in query groups bounding the score matrix), selects with the
kernel, and runs the decode attention kernel once over all the chunk's queries.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from mgserve.cuda.kbase import CudaBase, KVLayer, TorchBase, check_f32, check_index, shape_error

if TYPE_CHECKING:
    from cuda.core import Kernel

ATTN_SOURCE = "attention.cu"
UTIL_SOURCE = "attention_util.cu"
SELECT_SOURCE = "qsa_select.cu"
SEL_THREADS = 1024  # SEL_THREADS in qsa_select.cu: one CTA per query row
ATT_THREADS = 128  # ATT_THREADS in attention.cu: 4 warps
ATT_WARPS = 4
ATT_TILE = 16 * ATT_WARPS  # positions per pipeline stage
ATT_STAGES = 2  # ATT_STAGES in attention.cu (default)
MAX_SPLITS = 128  # ATT_MAX_SPLITS in attention.cu: chunks per session at most
COMBINE_THREADS = 128
MAX_GROUP = 16  # query heads per KV head the kernel holds (one m16 tensor-core tile)
HEAD_DIMS = (64, 128, 256)  # head dims attention.cu is instantiated for
DENSE_MIN_CHUNK = 256  # positions per CTA at least, dense / windowed decode
QSA_MIN_CHUNK = 64  # QSA decode: ~2k selected cells per query, so smaller chunks for more CTAs
QSA_PREFILL_MIN_CHUNK = 1088  # QSA prefill: a selection's ~2k cells in two chunks per query
QS_THREADS = 256  # QS_THREADS in attention_util.cu
QS_KEYS = 256  # QS_KEYS in attention_util.cu: block keys scored per CTA
QS_MAX_HI, QS_MAX_DI = 8, 256  # indexer heads / head dim the scoring kernel supports
KV_WRITE_MAX_DIM = 1024  # one thread per value of a head
PREFILL_DECODE_MAX_T = 8  # prefill chunks up to this long run the decode kernel per token
_SCORE_ELEMS = 1 << 26  # bound on the [.., T, S] score elements of one torch prefill chunk
_GATHER_ELEMS = 1 << 26  # bound on gathered K/V + block-score elements per torch QSA group
_F16_COPY_POS = 16384  # positions dequantized per step when making f16 K/V for SDPA
_PREFILL_SCORE_ELEMS = 1 << 26  # bound on the [T * H_idx, n_blk] fp32 scores of QSA prefill
_PREFILL_PART_ELEMS = 1 << 26  # bound on the [T, H, splits, D] fp32 partials of one prefill launch
_KV_DTYPES = (torch.int8, torch.float16, torch.float32, torch.bfloat16)
_NEG_INF = float("-inf")
_KEY_MIN = -(1 << 63)  # rank key of blocks that cannot be selected


# ---- checks -----------------------------------------------------------------------------------


def _check_layer(name: str, c: KVLayer) -> None:
    vals = c.values
    if vals.dim() != 4:
        raise shape_error(f"{name}.values", vals, "[n_slots, n_ctx, n_kv, head_dim]")
    if vals.dtype not in _KV_DTYPES:
        raise ValueError(f"{name}.values must be one of {_KV_DTYPES}, got {vals.dtype}")
    if c.quantized:
        if vals.shape[3] % 32:
            raise ValueError(f"{name}: q8_0 needs head_dim divisible by 32, got {vals.shape[3]}")
        want = (*vals.shape[:3], vals.shape[3] // 32)
        if c.scales.dtype != torch.float16 or tuple(c.scales.shape) != want:
            raise ValueError(
                f"{name}.scales must be float16 {list(want)}, got {c.scales.dtype} "
                f"{list(c.scales.shape)}"
            )


def _check_kv(k: KVLayer, v: KVLayer) -> tuple[int, int, int, int]:
    """(n_slots, n_ctx, n_kv, head_dim) of a K/V pair of pools."""
    _check_layer("k", k)
    _check_layer("v", v)
    if k.values.shape != v.values.shape:
        raise ValueError(
            f"k pool {list(k.values.shape)} and v pool {list(v.values.shape)} differ in shape"
        )
    n_slots, n_ctx, n_kv, d = k.values.shape
    return n_slots, n_ctx, n_kv, d


def _check_q(q: torch.Tensor, n_kv: int, d: int, what: str) -> tuple[int, int]:
    """(rows, heads) of q [rows, H, D] float32 with H a multiple of n_kv."""
    check_f32("q", q)
    if q.dim() != 3 or q.shape[2] != d:
        raise shape_error("q", q, f"[{what}, H, {d}] (head_dim of the pools)")
    if q.shape[1] % n_kv:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the {n_kv} KV heads")
    return q.shape[0], q.shape[1]


def _check_qsa(
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


def _check_select(scores: torch.Tensor, lengths: torch.Tensor, ratio: int, top: int) -> None:
    check_f32("scores", scores)
    if scores.dim() != 2:
        raise shape_error("scores", scores, "[N, n_cols]")
    check_index("lengths", lengths, scores.shape[0])
    if ratio < 1 or top < 1:
        raise ValueError(f"QSA selection needs ratio >= 1 and top >= 1, got {ratio}, {top}")


def _check_span(n_ctx: int, n_slots: int, slot: int, start: int, t: int) -> None:
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot {slot} outside the pool's {n_slots} slots")
    if start < 0 or start + t > n_ctx:
        raise ValueError(f"positions {start}..{start + t - 1} do not fit {n_ctx} positions")


# ---- shared torch pieces ----------------------------------------------------------------------


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float32 -> (int8 [..., D], f16 scales [..., D / 32]), bit-identical to
    ``mgserve.core.models.kvcache.quantize_q8_0`` on any device: the divisor 127 is a tensor,
    because CUDA torch turns division by a Python scalar into a multiply by its reciprocal
    (an ulp off)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)  # [..., D/32, 32]
    amax = blocks.abs().amax(dim=-1)
    d = amax / amax.new_full((1,), 127.0)  # [..., D/32]
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    scaled = blocks * inv[..., None]
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: half away from zero
    return q.to(torch.int8).reshape(x.shape), d.to(torch.float16)


def _dequant(c: KVLayer, *index: Any) -> torch.Tensor:
    """float32 ``c.values[index]`` (the same leading index applied to the q8_0 scales)."""
    vals = c.values[index]
    if not c.quantized:
        return vals.float()
    scales = c.scales[index].float()
    return (vals.float().unflatten(-1, (-1, 32)) * scales[..., None]).flatten(-2)


def _attend(
    q: torch.Tensor,  # [T, H, D]
    kf: torch.Tensor,  # [S, Hkv, D] float32
    vf: torch.Tensor,
    visible: torch.Tensor,  # [T, S] bool
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [T, H * D]
    """Masked softmax attention with grouped KV heads; rows with nothing visible give zeros."""
    t, h, d = q.shape
    n_kv = kf.shape[1]
    scores = torch.einsum("tkgd,skd->kgts", q.view(t, n_kv, h // n_kv, d), kf) * scale
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, _NEG_INF)  # [Hkv, G, T, S]
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("kgts,skd->tkgd", probs, vf).reshape(t, h * d)


def _qsa_positions(
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


def _attend_cells(
    q: torch.Tensor,  # [N, H, D]
    k: KVLayer,
    v: KVLayer,
    slot_rows: torch.Tensor,  # [N] int64 slot of each query
    pos: torch.Tensor,  # [N, L] int64 selected positions
    valid: torch.Tensor,  # [N, L] bool
    scale: float,
) -> torch.Tensor:  # [N, H * D]
    """Softmax attention of each query over exactly its selected (valid) cells."""
    n, h, d = q.shape
    kf = _dequant(k, slot_rows[:, None], pos)  # [N, L, Hkv, D]
    vf = _dequant(v, slot_rows[:, None], pos)
    n_kv = kf.shape[2]
    scores = torch.einsum("nkgd,nlkd->nkgl", q.view(n, n_kv, h // n_kv, d), kf) * scale
    mask = ~valid[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(mask, _NEG_INF), dim=-1).masked_fill(mask, 0.0)
    return torch.einsum("nkgl,nlkd->nkgd", probs, vf).reshape(n, h * d)


def _block_scores(iq: torch.Tensor, bl: torch.Tensor) -> torch.Tensor:
    """sum_h relu(iq[., h] . block) / sqrt(D_idx): iq [N, H_idx, D], bl [N, n_blk, D] or
    [n_blk, D] (shared) -> [N, n_blk]."""
    if bl.dim() == 2:
        s = torch.einsum("nhd,kd->nkh", iq, bl)
    else:
        s = torch.einsum("nhd,nkd->nkh", iq, bl)
    return torch.relu(s).sum(dim=-1) / math.sqrt(iq.shape[-1])


def _mask_incomplete(scores: torch.Tensor, lengths: torch.Tensor, ratio: int) -> torch.Tensor:
    blk = torch.arange(scores.shape[1], device=scores.device)
    return scores.masked_fill(blk[None, :] >= (lengths // ratio)[:, None], _NEG_INF)


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


# ---- torch ------------------------------------------------------------------------------------


class AttentionTorch(TorchBase):
    """Attention in plain PyTorch on the pools' device (static shapes for decode)."""

    def kv_write(
        self,
        cache: KVLayer,
        x: torch.Tensor,  # [N, n_kv, D] float32
        slots: torch.Tensor,  # [N] int32
        pos: torch.Tensor,  # [N] int32
    ) -> None:
        """Write token i's ``x[i]`` at (slots[i], pos[i]) of ``cache`` (q8_0: rounded exactly as
        the reference cache rounds)."""
        _check_layer("cache", cache)
        check_f32("x", x)
        if x.dim() != 3 or tuple(x.shape[1:]) != tuple(cache.values.shape[2:]):
            raise shape_error("x", x, f"[N, {cache.values.shape[2]}, {cache.values.shape[3]}]")
        check_index("slots", slots, x.shape[0])
        check_index("pos", pos, x.shape[0])
        index = (slots.long(), pos.long())
        if cache.quantized:
            q, d = quantize_q8_0(x)
            cache.values.index_put_(index, q)
            cache.scales.index_put_(index, d)
        else:
            cache.values.index_put_(index, x.to(cache.values.dtype))

    def kv_read(self, cache: KVLayer, slot: int, end: int) -> torch.Tensor:
        """float32 [end, n_kv, D]: positions 0..end-1 of ``slot``, dequantized."""
        _check_layer("cache", cache)
        n_slots, n_ctx = cache.values.shape[:2]
        _check_span(n_ctx, n_slots, slot, 0, end)
        return _dequant(cache, slot, slice(0, end))

    def attention_decode(
        self,
        q: torch.Tensor,  # [B, H, D] float32
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,  # [B] int32
        lengths: torch.Tensor,  # [B] int32
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [B, H * D]
        """One query per session over its slot's first ``lengths[b]`` positions (a mask over
        all n_ctx positions: static shapes, one session at a time to bound memory)."""
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        b, _ = _check_q(q, n_kv, d, "B")
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        key_pos = torch.arange(n_ctx, device=q.device)
        outs = []
        for i in range(b):
            s = slots[i : i + 1].long()
            kf, vf = _dequant(k, s)[0], _dequant(v, s)[0]  # [n_ctx, Hkv, D]
            length = lengths[i].long()
            visible = key_pos < length
            if window > 0:
                visible &= length - 1 - key_pos < window
            outs.append(_attend(q[i : i + 1], kf, vf, visible[None], scale, softcap))
        if not outs:
            return q.new_zeros((0, q.shape[1] * d))
        return torch.cat(outs)

    def attention_prefill(
        self,
        q: torch.Tensor,  # [T, H, D] float32
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [T, H * D]
        """One session's chunk: query j at position start + j sees keys 0..start+j (already
        written), in query chunks that bound the score matrix."""
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        t, h = _check_q(q, n_kv, d, "T")
        _check_span(n_ctx, n_slots, slot, start, t)
        end = start + t
        k0 = max(0, start - window + 1) if window > 0 else 0  # no query sees keys before k0
        kf = _dequant(k, slot, slice(k0, end))  # [S, Hkv, D]
        vf = _dequant(v, slot, slice(k0, end))
        key_pos = torch.arange(k0, end, device=q.device)
        chunk = max(1, _SCORE_ELEMS // max(1, h * (end - k0)))
        outs = []
        for c in range(0, t, chunk):
            q_pos = torch.arange(start + c, start + min(t, c + chunk), device=q.device)
            visible = key_pos[None, :] <= q_pos[:, None]
            if window > 0:
                visible &= q_pos[:, None] - key_pos[None, :] < window
            outs.append(_attend(q[c : c + chunk], kf, vf, visible, scale, softcap))
        if not outs:
            return q.new_zeros((0, h * d))
        return torch.cat(outs)

    def qsa_select_blocks(
        self,
        scores: torch.Tensor,  # [N, n_cols] float32 block scores
        lengths: torch.Tensor,  # [N] int32 / int64: query at lengths - 1
        *,
        ratio: int,
        top: int,
    ) -> torch.Tensor:  # [N, top] int32
        """Each query's QSA selection: ``select_blocks`` with checked arguments."""
        _check_select(scores, lengths, ratio, top)
        return select_blocks(scores, lengths, ratio, top)

    def qsa_decode(
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
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        b, _ = _check_q(q, n_kv, d, "B")
        _check_qsa(iq, blocks, b, n_ctx, ratio, budget)
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        top, n_blk = budget // ratio, blocks.shape[1]
        lengths_l = lengths.long()
        sel = None
        if n_blk > top:  # otherwise no query can have more than `top` complete blocks
            rows = [
                _block_scores(iq[i : i + 1], blocks.index_select(0, slots[i : i + 1].long())[0])
                for i in range(b)
            ]
            sel = self.qsa_select_blocks(torch.cat(rows), lengths_l, ratio=ratio, top=top)
        pos, valid = _qsa_positions(sel, lengths_l, ratio, top, n_ctx)
        return _attend_cells(q, k, v, slots.long(), pos, valid, scale)

    def qsa_prefill(
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
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        t, h = _check_q(q, n_kv, d, "T")
        _check_qsa(iq, blocks, t, n_ctx, ratio, budget)
        _check_span(n_ctx, n_slots, slot, start, t)
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
                sel = select_blocks(_block_scores(iq[c0:c1], bl), lengths, ratio, top)
            pos, valid = _qsa_positions(sel, lengths, ratio, top, n_ctx)
            rows = torch.full((c1 - c0,), slot, dtype=torch.long, device=dev)
            outs.append(_attend_cells(q[c0:c1], k, v, rows, pos, valid, scale))
        if not outs:
            return q.new_zeros((0, h * d))
        return torch.cat(outs)


# ---- CUDA -------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_smem_bytes(head_dim: int, k_q8: bool, v_q8: bool) -> int:
    """Dynamic shared memory of attn_decode (SMEM_B in attention.cu, same formula): Q fragments,
    then ATT_STAGES stages of padded K/V rows (+ q8 scales), overlaid by the final warp merge."""

    def pad(row_w: int, targets: tuple[int, ...], m: int) -> int:
        return min((t - row_w) % m for t in targets)

    k_row_w = head_dim * (1 if k_q8 else 2) // 4
    v_row_w = head_dim * (1 if v_q8 else 2) // 4
    k_row = (k_row_w + (pad(k_row_w, (8, 24), 32) if k_q8 else pad(k_row_w, (16,), 32))) * 4
    v_row = (v_row_w + pad(v_row_w, (4, 12), 16)) * 4
    sc_row = head_dim // 32 * 2
    stage = ATT_TILE * (k_row + v_row) + ATT_TILE * sc_row * (int(k_q8) + int(v_q8))
    q_frag = head_dim // 16 * 2 * 32 * 16
    merge = ATT_WARPS * 16 * head_dim * 4
    return q_frag + max(ATT_STAGES * stage, merge)


def _allow_smem(kernel: Kernel, nbytes: int, device_index: int) -> None:
    """Let ``kernel`` use ``nbytes`` of dynamic shared memory (above the 48 KB default)."""
    from cuda.bindings import driver

    handle = kernel.handle  # a CUkernel (cuda.core loads cubins as libraries)
    if not isinstance(handle, driver.CUkernel):
        handle = driver.CUkernel(int(handle))
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, driver.CUdevice(device_index))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(max dynamic smem {nbytes}) failed: {err}")


class AttentionCuda(CudaBase, AttentionTorch):
    """The attention ops on NVRTC kernels (torch versions for pool types, head dims or group
    sizes the kernels do not cover: bf16 / f32 pools, head_dim not in HEAD_DIMS, > 16 query heads
    per KV head)."""

    # -- helpers ---------------------------------------------------------------------------------

    def _attn_i32(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, expected {self.device}")
        return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()

    def _on_device(self, *ts: torch.Tensor) -> bool:
        return all(t.device == self.device for t in ts)

    def _fast(self, q: torch.Tensor, k: KVLayer, v: KVLayer) -> bool:
        """Whether attn_decode covers these pools and heads."""
        kinds = (torch.int8, torch.float16)
        d, n_kv = k.values.shape[3], k.values.shape[2]
        return (
            k.values.dtype in kinds
            and v.values.dtype in kinds
            and d in HEAD_DIMS
            and q.shape[1] // n_kv <= MAX_GROUP
            and self._on_device(q, k.values, v.values)
            and all(t.is_contiguous() for t in (k.values, k.scales, v.values, v.scales))
        )

    def _decode_kernels(self, d: int, k_q8: bool, v_q8: bool) -> tuple[Kernel, Kernel, int]:
        smem = decode_smem_bytes(d, k_q8, v_q8)
        defines = (
            ("HEAD_DIM", str(d)),
            ("K_Q8", str(int(k_q8))),
            ("V_Q8", str(int(v_q8))),
            ("EXPECT_SMEM", str(smem)),  # the kernel static_asserts the same count
        )
        kern = self.kernel(ATTN_SOURCE, "attn_decode", defines)
        ready: set[int] = self.__dict__.setdefault("_attn_smem_ready", set())
        if id(kern) not in ready:
            _allow_smem(kern, smem, self.compiler.device_index)
            ready.add(id(kern))
        return kern, self.kernel(ATTN_SOURCE, "attn_combine", defines), smem

    def _run_decode(
        self,
        q: torch.Tensor,  # [B, H, D] contiguous float32
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,  # [B] int32
        lengths: torch.Tensor,  # [B] int32
        sel: torch.Tensor | None,  # [B, top] int32 selected blocks (QSA) or None (dense)
        *,
        scale: float,
        bound: int,  # most visible (virtual) positions of any session: sizes the grid
        softcap: float = 0.0,
        window: int = 0,
        min_chunk: int = DENSE_MIN_CHUNK,
        top: int = 0,  # QSA: blocks selected per query
        ratio: int = 1,  # QSA: positions per block
    ) -> torch.Tensor:  # [B, H * D]
        b, h, d = q.shape
        n_ctx, n_kv = k.values.shape[1], k.values.shape[2]
        out = torch.empty((b, h * d), dtype=torch.float32, device=self.device)
        if b == 0:
            return out
        n_splits = max(1, min(MAX_SPLITS, _cdiv(bound, min_chunk)))
        part_o = torch.empty((b, h, n_splits, d), dtype=torch.float32, device=self.device)
        part_ml = torch.empty((b, h, n_splits, 2), dtype=torch.float32, device=self.device)
        kern, comb, smem = self._decode_kernels(d, k.quantized, v.quantized)
        qsa = sel is not None
        self.launch(
            kern,
            (n_splits, n_kv, b),
            ATT_THREADS,
            q.data_ptr(),
            k.values.data_ptr(),
            k.scales.data_ptr() if k.quantized else 0,
            v.values.data_ptr(),
            v.scales.data_ptr() if v.quantized else 0,
            slots.data_ptr(),
            lengths.data_ptr(),
            sel.data_ptr() if sel is not None else 0,
            part_o.data_ptr(),
            part_ml.data_ptr(),
            np.int32(n_ctx),
            np.int32(n_kv),
            np.int32(h // n_kv),
            np.float32(scale),
            np.float32(softcap),
            np.int32(window),
            np.int32(min_chunk),
            np.int32(top),
            np.int32(ratio),
            shmem=smem,
        )
        self.launch(
            comb,
            (h, b),
            COMBINE_THREADS,
            part_o.data_ptr(),
            part_ml.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            np.int32(n_ctx),
            np.int32(h),
            np.int32(n_splits),
            np.int32(window),
            np.int32(min_chunk),
            np.int32(1 if qsa else 0),
            np.int32(top),
            np.int32(ratio),
        )
        return out

    def _qsa_scores(
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
        stride = _cdiv(n_cols, 4) * 4
        scores = torch.empty((n, stride), dtype=torch.float32, device=self.device)
        self.launch(
            self.kernel(UTIL_SOURCE, "qsa_scores"),
            (_cdiv(n_cols, QS_KEYS), n),
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

    def _select(
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
            self.launch(
                self.kernel(SELECT_SOURCE, "qsa_select"),
                n,
                SEL_THREADS,
                scores.data_ptr(),
                lengths.data_ptr(),
                sel.data_ptr(),
                np.int32(stride),
                np.int32(n_cols),
                np.int32(ratio),
                np.int32(top),
            )
        return sel

    def _qsa_select(
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
        scores = self._qsa_scores(iq, blocks, slots, lengths, n_cols, ratio, top)
        return self._select(scores, lengths, n_cols, ratio, top)

    def _prefill_select(
        self,
        iq: torch.Tensor,  # [T, H_idx, D_idx]
        blocks: torch.Tensor,  # [n_slots, n_ctx / ratio, D_idx]
        slot: int,
        lengths: torch.Tensor,  # [T] int32: query j at lengths[j] - 1
        n_blk: int,  # blocks complete by the last query
        ratio: int,
        top: int,
    ) -> torch.Tensor:  # [T, top] int32
        """QSA prefill selection: every query of the chunk scored against the complete blocks by
        one fp32 matmul per group of queries (cuBLAS reuses each block key across queries; the
        groups bound the [queries * H_idx, blocks] score matrix by _PREFILL_SCORE_ELEMS), then
        qsa_select per group. Scores of blocks a query cannot see yet are computed but never
        read (the kernel reads blocks < lengths / ratio only)."""
        t, n_hi, di = iq.shape
        stride = _cdiv(n_blk, 4) * 4
        bl = blocks[slot, : min(stride, blocks.shape[1])]  # [<= stride, D_idx]
        if bl.shape[0] < stride:
            bl = F.pad(bl, (0, 0, 0, stride - bl.shape[0]))
        blt = bl.t()  # [D_idx, stride]
        sel = torch.empty((t, top), dtype=torch.int32, device=self.device)
        group = max(1, _PREFILL_SCORE_ELEMS // (n_hi * stride))
        for c0 in range(0, t, group):
            c1 = min(t, c0 + group)
            s = torch.matmul(iq[c0:c1].reshape(-1, di), blt)  # [(c1 - c0) * H_idx, stride]
            scores = s.view(c1 - c0, n_hi, stride).relu_().sum(dim=1)  # [c1 - c0, stride]
            scores.div_(math.sqrt(di))
            self._select(scores, lengths[c0:c1], n_blk, ratio, top, out=sel[c0:c1])
        return sel

    def _run_prefill(
        self,
        q: torch.Tensor,  # [T, H, D] contiguous
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        sel: torch.Tensor | None,  # [T, top] int32 (QSA) or None (dense causal)
        *,
        scale: float,
        bound: int,
        top: int = 0,
        ratio: int = 1,
    ) -> torch.Tensor:  # [T, H * D]
        """The decode kernel over every query of one session's chunk (query j a virtual session
        at position start + j), in as few launches as _PREFILL_PART_ELEMS allows (one for a
        4096-token chunk of qwen4exp)."""
        t, h, d = q.shape
        slots = torch.full((t,), slot, dtype=torch.int32, device=self.device)
        lengths = torch.arange(start + 1, start + t + 1, dtype=torch.int32, device=self.device)
        n_splits = max(1, min(MAX_SPLITS, _cdiv(bound, QSA_PREFILL_MIN_CHUNK)))
        group = max(1, _PREFILL_PART_ELEMS // (h * n_splits * d))
        outs = []
        for c0 in range(0, t, group):
            c1 = min(t, c0 + group)
            outs.append(self._run_decode(
                q[c0:c1], k, v, slots[c0:c1], lengths[c0:c1],
                None if sel is None else sel[c0:c1], scale=scale, bound=bound,
                min_chunk=QSA_PREFILL_MIN_CHUNK, top=top, ratio=ratio,
            ))  # fmt: skip
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _qsa_fast(
        self, q: torch.Tensor, iq: torch.Tensor, k: KVLayer, v: KVLayer, blocks: torch.Tensor
    ) -> bool:
        n_hi, di = iq.shape[1], iq.shape[2]
        return (
            self._fast(q, k, v)
            and n_hi <= QS_MAX_HI
            and di <= QS_MAX_DI
            and di % 32 == 0
            and blocks.is_contiguous()
            and self._on_device(iq, blocks)
        )

    # -- ops -------------------------------------------------------------------------------------

    def kv_write(
        self, cache: KVLayer, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor
    ) -> None:
        kinds = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
        kind = kinds.get(cache.values.dtype)
        d = cache.values.shape[-1] if cache.values.dim() == 4 else 0
        if kind is None or d > KV_WRITE_MAX_DIM or not self._on_device(cache.values, x):
            super().kv_write(cache, x, slots, pos)
            return
        _check_layer("cache", cache)
        check_f32("x", x)
        n_ctx, n_kv = cache.values.shape[1], cache.values.shape[2]
        if x.dim() != 3 or tuple(x.shape[1:]) != (n_kv, d):
            raise shape_error("x", x, f"[N, {n_kv}, {d}]")
        check_index("slots", slots, x.shape[0])
        check_index("pos", pos, x.shape[0])
        if not cache.values.is_contiguous() or (
            cache.quantized and not cache.scales.is_contiguous()
        ):
            raise ValueError("cache pools must be contiguous")
        if x.shape[0] == 0:
            return
        x = x.contiguous()
        self.launch(
            self.kernel(UTIL_SOURCE, "kv_write"),
            (x.shape[0], n_kv),
            d,
            x.data_ptr(),
            cache.values.data_ptr(),
            cache.scales.data_ptr() if cache.quantized else 0,
            self._attn_i32("slots", slots).data_ptr(),
            self._attn_i32("pos", pos).data_ptr(),
            np.int32(n_ctx),
            np.int32(n_kv),
            np.int32(kind),
        )

    def attention_decode(
        self,
        q: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        b, _ = _check_q(q, n_kv, d, "B")
        if not self._fast(q, k, v):
            return super().attention_decode(
                q, k, v, slots, lengths, scale=scale, window=window, softcap=softcap
            )
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        slots, lengths = self._attn_i32("slots", slots), self._attn_i32("lengths", lengths)
        bound = min(n_ctx, window) if window > 0 else n_ctx
        return self._run_decode(
            q.contiguous(), k, v, slots, lengths, None, scale=scale, bound=bound, softcap=softcap,
            window=window,
        )  # fmt: skip

    def attention_prefill(
        self,
        q: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        t, h = _check_q(q, n_kv, d, "T")
        _check_span(n_ctx, n_slots, slot, start, t)
        if not self._fast(q, k, v) or (softcap > 0.0 and t > PREFILL_DECODE_MAX_T):
            return super().attention_prefill(
                q, k, v, slot, start, scale=scale, window=window, softcap=softcap
            )
        end = start + t
        if t <= PREFILL_DECODE_MAX_T:  # one virtual session per token: decode numerics
            slots = torch.full((t,), slot, dtype=torch.int32, device=self.device)
            lengths = torch.arange(start + 1, end + 1, dtype=torch.int32, device=self.device)
            bound = min(end, window) if window > 0 else end
            return self._run_decode(
                q.contiguous(), k, v, slots, lengths, None, scale=scale, bound=bound,
                softcap=softcap, window=window,
            )  # fmt: skip
        k0 = max(0, start - window + 1) if window > 0 else 0
        kh = self._f16_heads(k, slot, k0, end)  # [Hkv, S, D]
        vh = self._f16_heads(v, slot, k0, end)
        qh = q.permute(1, 0, 2).to(torch.float16)[None]  # [1, H, T, D]
        if window > 0:  # few keys: an explicit mask, K/V repeated per query head
            key_pos = torch.arange(k0, end, device=self.device)
            q_pos = torch.arange(start, end, device=self.device)
            mask = (key_pos[None, :] <= q_pos[:, None]) & (
                q_pos[:, None] - key_pos[None, :] < window
            )
            g = h // n_kv
            y = F.scaled_dot_product_attention(
                qh,
                kh.repeat_interleave(g, 0)[None],
                vh.repeat_interleave(g, 0)[None],
                attn_mask=mask,
                scale=scale,
            )
        else:
            from torch.nn.attention.bias import causal_lower_right

            y = F.scaled_dot_product_attention(
                qh,
                kh[None],
                vh[None],
                attn_mask=causal_lower_right(t, end - k0),
                scale=scale,
                enable_gqa=True,
            )
        return y[0].permute(1, 0, 2).reshape(t, h * d).float()

    def _f16_heads(self, c: KVLayer, slot: int, k0: int, end: int) -> torch.Tensor:
        """float16 [n_kv, end - k0, D]: positions k0..end-1 of ``slot``, dequantized in pieces."""
        n_kv, d = c.values.shape[2], c.values.shape[3]
        out = torch.empty((n_kv, end - k0, d), dtype=torch.float16, device=self.device)
        for p0 in range(k0, end, _F16_COPY_POS):
            p1 = min(end, p0 + _F16_COPY_POS)
            out[:, p0 - k0 : p1 - k0] = _dequant(c, slot, slice(p0, p1)).transpose(0, 1)
        return out

    def qsa_select_blocks(
        self, scores: torch.Tensor, lengths: torch.Tensor, *, ratio: int, top: int
    ) -> torch.Tensor:
        _check_select(scores, lengths, ratio, top)
        if not self._on_device(scores, lengths):
            return super().qsa_select_blocks(scores, lengths, ratio=ratio, top=top)
        n, n_cols = scores.shape
        stride = _cdiv(n_cols, 4) * 4
        if stride != n_cols or not scores.is_contiguous() or scores.data_ptr() % 16:
            padded = torch.empty((n, stride), dtype=torch.float32, device=self.device)
            padded[:, :n_cols] = scores
            scores = padded
        return self._select(scores, self._attn_i32("lengths", lengths), n_cols, ratio, top)

    def qsa_decode(
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
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        b, _ = _check_q(q, n_kv, d, "B")
        _check_qsa(iq, blocks, b, n_ctx, ratio, budget)
        if not self._qsa_fast(q, iq, k, v, blocks):
            return super().qsa_decode(
                q, iq, k, v, blocks, slots, lengths, ratio=ratio, budget=budget, scale=scale
            )
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        slots, lengths = self._attn_i32("slots", slots), self._attn_i32("lengths", lengths)
        top, n_blk, qc = budget // ratio, blocks.shape[1], q.contiguous()
        if n_blk <= top:  # no session can have more than `top` complete blocks: dense
            return self._run_decode(qc, k, v, slots, lengths, None, scale=scale, bound=n_ctx)
        sel = self._qsa_select(iq.contiguous(), blocks, slots, lengths, n_blk, ratio, top)
        bound = min(n_ctx, top * ratio + ratio - 1)
        return self._run_decode(
            qc, k, v, slots, lengths, sel, scale=scale, bound=bound, min_chunk=QSA_MIN_CHUNK,
            top=top, ratio=ratio,
        )  # fmt: skip

    def qsa_prefill(
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
        n_slots, n_ctx, n_kv, d = _check_kv(k, v)
        t, h = _check_q(q, n_kv, d, "T")
        _check_qsa(iq, blocks, t, n_ctx, ratio, budget)
        _check_span(n_ctx, n_slots, slot, start, t)
        if not self._qsa_fast(q, iq, k, v, blocks):
            return super().qsa_prefill(
                q, iq, k, v, blocks, slot, start, ratio=ratio, budget=budget, scale=scale
            )
        top, end = budget // ratio, start + t
        n_blk = end // ratio  # blocks complete by the chunk's last query
        if t == 0:
            return q.new_zeros((0, h * d))
        qc = q.contiguous()
        if n_blk <= top:  # every query of the chunk is dense
            return self._run_prefill(qc, k, v, slot, start, None, scale=scale, bound=end)
        lengths = torch.arange(start + 1, end + 1, dtype=torch.int32, device=self.device)
        sel = self._prefill_select(iq, blocks, slot, lengths, n_blk, ratio, top)
        bound = min(end, top * ratio + ratio - 1)
        return self._run_prefill(
            qc, k, v, slot, start, sel, scale=scale, bound=bound, top=top, ratio=ratio
        )
