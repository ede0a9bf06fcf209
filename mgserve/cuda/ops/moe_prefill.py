"""The MoE experts of a prefill step (N > 8 tokens): sort, bucket, dequantize, batched products.

Prefill of the full-width qwen4exp (4096 tokens x top-10 of 256 experts) was bound by the host:
the expert chunks of the old path cost ~17 torch ops each, ~25 chunks a layer. This path makes
a fixed handful of launches per layer plus two cuBLAS calls per bucket:

1. the (token, slot) pairs sorted by expert on the device and the per-expert counts copied to
   the host (the layer's one sync);
2. on the host (``plan_moe``, numpy): the used experts ordered by count, largest first, and cut
   into buckets whose counts are within ``BUCKET_RATIO`` of the bucket's largest (or all at most
   ``BUCKET_MIN_ROWS``), each expert's rows padded to its bucket's largest count;
3. the used experts' gate/up and down matrices dequantized to f16 in that order, one launch per
   matrix (``MOE_SCRATCH_BYTES`` bounds the f16 scratch; more experts than fit take several
   passes, each with its own launches and buckets);
4. per bucket two batched products (gate/up, then down) over its experts, on the padded rows;
5. one kernel each for the row maps, the gather of x (rounded to f16), silu(gate) * up, and the
   weighted sum of each token's kk results in a fixed order.

``moe_prefill`` is the algorithm; the glue steps (dequantization, row maps, gather, silu * up,
combine) come from a steps object: ``MoePrefillTorch`` here, in plain torch (the CPU tests run it
against the reference MoE; its f16 products are emulated by upcasting), or ``MoePrefillCuda``
(moe_prefill_cuda.py) with kernels/moe_prefill.cu. ``MoeCuda.experts`` runs it for N > 8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops.f16_products import f16_bmm_into
from mgserve.cuda.ops.moe import ExpertWeights, combine

if TYPE_CHECKING:
    from mgserve.cuda.ops.moe_prefill_cuda import MoePrefillCuda

MOE_SCRATCH_BYTES = 4 << 30  # f16 experts dequantized at once (256 experts of qwen4exp: 2.5 GB)
BUCKET_RATIO = 1.25  # an expert joins a bucket if its count is >= the bucket's largest / this
BUCKET_MIN_ROWS = 64  # experts with at most this many pairs share one bucket padded to its max


class Bucket(NamedTuple):
    """Experts [first, first + n) of the plan's order, each padded to ``rows`` rows, occupying
    padded rows [row0, row0 + n * rows)."""

    first: int
    n: int
    rows: int
    row0: int


class MoePlan(NamedTuple):
    """Where every pair of one layer's prefill goes (host numpy, from the per-expert counts)."""

    experts: np.ndarray  # [U] int32 used expert ids, largest count first (ties: lower id)
    shift: np.ndarray  # [E] int32: sorted position q of expert e lands on padded row q + shift[e]
    passes: list[tuple[int, int, list[Bucket]]]  # (first expert, n experts, buckets) per scratch
    n_rows: int  # R, padded rows in all


def plan_moe(
    counts: np.ndarray,  # [E] pairs per expert
    per_pass: int,  # experts whose weights fit the scratch at once (>= 1)
    ratio: float = BUCKET_RATIO,
    min_rows: int = BUCKET_MIN_ROWS,
) -> MoePlan:
    """Bucket the used experts by count (see the module docstring). Padding costs at most a
    factor ``ratio`` on buckets above ``min_rows`` rows; the number of buckets is about
    log(max count / min_rows) / log(ratio) (<= 20 for 4096 tokens)."""
    if per_pass < 1 or ratio < 1 or min_rows < 1:
        raise ValueError(f"plan_moe: per_pass {per_pass}, ratio {ratio}, min_rows {min_rows}")
    counts = np.asarray(counts, dtype=np.int64)
    used = np.flatnonzero(counts)
    order = used[np.argsort(-counts[used], kind="stable")]  # [U] count descending, ids ascending
    cnt = counts[order]  # [U] descending
    neg = -cnt  # ascending, for searchsorted
    row0 = np.zeros(len(order), dtype=np.int64)  # [U] first padded row of each expert
    passes: list[tuple[int, int, list[Bucket]]] = []
    row = 0
    for p0 in range(0, len(order), per_pass):
        p1 = min(len(order), p0 + per_pass)
        buckets: list[Bucket] = []
        i = p0
        while i < p1:
            m = int(cnt[i])
            if m <= min_rows:
                j = p1
            else:  # first expert below m / ratio (cnt is descending)
                j = p0 + int(np.searchsorted(neg[p0:p1], -m / ratio, side="right"))
                j = max(j, i + 1)
            g = j - i
            buckets.append(Bucket(i, g, m, row))
            row0[i:j] = row + m * np.arange(g)
            row += g * m
            i = j
        passes.append((p0, p1 - p0, buckets))
    starts = np.cumsum(counts) - counts  # [E] first sorted position of each expert
    shift = np.zeros(len(counts), dtype=np.int64)
    shift[order] = row0 - starts[order]
    return MoePlan(order.astype(np.int32), shift.astype(np.int32), passes, row)


def moe_prefill(
    steps: MoePrefillTorch | MoePrefillCuda,
    x: torch.Tensor,
    w: ExpertWeights,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x), e = experts[:, j], computed on
    f16 operands with fp32 accumulation (x, the weights and h rounded to f16).

    x [N, d] fp32, experts [N, kk] int32 (clamped to [0, E)), weights [N, kk] fp32 -> [N, d]
    fp32. Inputs are assumed checked (``MoeCuda.experts`` does). One host sync."""
    n, kk = experts.shape
    d, e, ff = w.n_embd, w.n_expert, w.n_ff
    dev = x.device
    flat = experts.reshape(-1).clamp(0, e - 1)  # [P] expert of each pair (token * kk + slot)
    sorted_e, order = torch.sort(flat, stable=True)  # [P] pairs grouped by expert
    counts = torch.bincount(flat, minlength=e).cpu().numpy()  # [E] the one host sync
    per_expert = 3 * ff * d  # f16 values of one expert: gate + up [2 ff, d], down [d, ff]
    per_pass = max(1, MOE_SCRATCH_BYTES // (2 * per_expert))
    plan = plan_moe(counts, per_pass)
    tables = torch.from_numpy(np.concatenate((plan.shift, plan.experts))).to(dev)
    shift, ids = tables[:e], tables[e:]  # [E], [U] int32
    pair_row, row_token = steps.rows(sorted_e, order, shift, kk, plan.n_rows)
    xs = steps.gather(x, row_token)  # [R, d] f16
    gu = torch.empty(plan.n_rows, 2 * ff, dtype=torch.float32, device=dev)  # [R, 2 ff]
    h = torch.empty(plan.n_rows, ff, dtype=torch.float16, device=dev)  # [R, ff]
    y = torch.empty(plan.n_rows, d, dtype=torch.float32, device=dev)  # [R, d]
    buf = steps.scratch(min(per_pass, len(plan.experts)) * per_expert, dev)
    for p0, pn, buckets in plan.passes:
        wgu = buf[: pn * 2 * ff * d].view(pn, 2 * ff, d)  # [pn, 2 ff, d]: gate rows, up rows
        wdn = buf[pn * 2 * ff * d : pn * per_expert].view(pn, d, ff)  # [pn, d, ff]
        steps.dequant(w, ids[p0 : p0 + pn], wgu, wdn)
        r0 = buckets[0].row0
        r1 = buckets[-1].row0 + buckets[-1].n * buckets[-1].rows
        for b in buckets:
            rows = slice(b.row0, b.row0 + b.n * b.rows)
            sl = slice(b.first - p0, b.first - p0 + b.n)
            f16_bmm_into(xs[rows].view(b.n, b.rows, d), wgu[sl], gu[rows].view(b.n, b.rows, 2 * ff))
        steps.silu_mul(gu[r0:r1], h[r0:r1])
        for b in buckets:
            rows = slice(b.row0, b.row0 + b.n * b.rows)
            sl = slice(b.first - p0, b.first - p0 + b.n)
            f16_bmm_into(h[rows].view(b.n, b.rows, ff), wdn[sl], y[rows].view(b.n, b.rows, d))
    return steps.combine(y, pair_row.view(n, kk), weights)


class MoePrefillTorch:
    """The glue steps of ``moe_prefill`` in plain torch, on dequantized (cached) weights."""

    def __init__(self, dense: DenseWeights) -> None:
        self.dense = dense

    def scratch(self, n_elems: int, device: torch.device) -> torch.Tensor:
        """An f16 buffer of at least ``n_elems`` values for the dequantized experts."""
        return torch.empty(n_elems, dtype=torch.float16, device=device)

    def dequant(
        self, w: ExpertWeights, ids: torch.Tensor, wgu: torch.Tensor, wdn: torch.Tensor
    ) -> None:
        """Experts ``ids`` [g]: gate rows then up rows into wgu [g, 2 ff, d], down into wdn
        [g, d, ff] (f16)."""
        ff, d = w.n_ff, w.n_embd
        idx = ids.long()
        if w.gate_up is not None:
            wgu.copy_(self.dense(w.gate_up).view(-1, 2 * ff, d)[idx])
        else:
            assert w.gate is not None and w.up is not None
            wgu[:, :ff].copy_(self.dense(w.gate).view(-1, ff, d)[idx])
            wgu[:, ff:].copy_(self.dense(w.up).view(-1, ff, d)[idx])
        wdn.copy_(self.dense(w.down).view(-1, d, ff)[idx])

    def rows(
        self,
        sorted_e: torch.Tensor,  # [P] int32 expert of each sorted position
        order: torch.Tensor,  # [P] int64 pair at each sorted position
        shift: torch.Tensor,  # [E] int32
        kk: int,
        n_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # pair_row [P] int32, row_token [R] int32
        """The padded row of every pair, and the token of every padded row (0 for pad rows)."""
        rows = torch.arange(order.numel(), device=order.device) + shift[sorted_e.long()]  # [P]
        pair_row = torch.empty_like(rows).index_put_((order,), rows).to(torch.int32)
        row_token = torch.zeros(n_rows, dtype=torch.int32, device=order.device)
        row_token[rows] = (order // kk).to(torch.int32)
        return pair_row, row_token

    def gather(self, x: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
        """f16(x[row_token]) [R, d]."""
        return x.index_select(0, row_token.long()).to(torch.float16)

    def silu_mul(self, gu: torch.Tensor, h: torch.Tensor) -> None:
        """h [R, ff] f16 = silu(gu[:, :ff]) * gu[:, ff:] (fp32, rounded once)."""
        ff = h.shape[1]
        h.copy_(F.silu(gu[:, :ff]) * gu[:, ff:])

    def combine(
        self, y: torch.Tensor, pair_row: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """[N, d]: sum_j weights[:, j] * y[pair_row[:, j]] in the order j = 0, 1, ..."""
        sel = y.index_select(0, pair_row.reshape(-1).long()).view(*pair_row.shape, -1)
        return combine(sel, weights)  # sel [N, kk, d]
