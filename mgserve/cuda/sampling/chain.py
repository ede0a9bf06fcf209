"""The device sampling chain on logits [B, V]: bias, penalties, grammar masks, the filters and
the draw.

The stages and their order are ``SeqSampler``'s (core/engine/sampling.py), with the same
arithmetic; what differs is where the device needs another algorithm: every row of the batch at
once with static shapes (gathers and scatters over padded windows, one ``topk`` or sort for all
rows, masks instead of cuts), and the draw by Gumbel-max with counter-based noise (rng.py) instead
of ``torch.multinomial`` with a per-session generator. ``argmax(logit / T + Gumbel)`` is exactly a
draw from ``softmax(logit / T)`` over the kept candidates.

Cost at V = 248320 (float32 logits, B <= 8): each [B, V] elementwise pass moves ~8 MB (~2-4 us
on an H200). The common case (every sampling row has 0 < top_k < V) is: bias and penalties on a
few hundred entries (gather/scatter), one argmax and one ``torch.topk(K)`` over [B, V], then a
few dozen tiny ops on [B, K]. A row with top_k off and top_p < 1 needs the whole row sorted: one
``torch.sort`` of [B, V] (a segmented radix sort, roughly 0.1-0.3 ms) plus softmax, cumsum and
the hash over [B, V] (~20 passes of 8-16 MB, another ~0.1 ms). Rows with top_k and top_p both off
skip the sort but still hash the whole row. logprobs cost one log_softmax over [B, V] (+ a topk).
A grammar mask (some row constrained) unpacks [B, V / 32] words into [B, V] and masks: ~5 passes.
"""

from __future__ import annotations

import torch

from mgserve.core.grammar import apply_allowed, unpack_bitmask
from mgserve.cuda.sampling.inputs import SamplingBatch
from mgserve.cuda.sampling.plan import SORT, WHOLE, SamplingPlan
from mgserve.cuda.sampling.rng import row_keys, uniforms

COUNT_BY_COMPARE_MAX_W = 256  # penalty windows up to this wide are counted by a [B, W, W] compare


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] plus ``values`` [B, NB] at ``ids`` [B, NB], as a new tensor.

    Ids are distinct per row except for padding, which repeats a real (id, value) pair (or adds
    0.0 to id 0 on a row without bias): every write to one id carries the same value, so the
    scatter is deterministic."""
    return logits.scatter(1, ids, logits.gather(1, ids) + values)


def apply_penalties(
    x: torch.Tensor,
    window: torch.Tensor,
    repeat: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repeat, frequency and presence penalties on ``x`` [B, V] for the tokens of ``window``
    [B, W] (-1 padded), as a new tensor; the same arithmetic as the CPU sampler's
    ``apply_penalties`` (a positive logit divided by the repeat penalty, a negative one
    multiplied; then ``- count * frequency - presence``), in the same float32 order.

    Every window entry rewrites its token's logit with the penalized value; a padding entry
    points at the row's first token and so writes that token's value again (a row with an empty
    window rewrites token 0 with itself). Counts come from a [B, W, W] comparison for short
    windows, from a [B, V] histogram (exact float adds of 1) for long ones."""
    b, v = x.shape
    wn = window.shape[1]
    win = window.long()  # [B, W]
    valid = win >= 0
    idx = torch.where(valid, win, win[:, :1].clamp(min=0))  # [B, W]
    if wn <= COUNT_BY_COMPARE_MAX_W:
        count = (idx[:, :, None] == win[:, None, :]).sum(-1, dtype=torch.float32)  # [B, W]
    else:
        hist = torch.zeros(b, v + 1, dtype=torch.float32, device=x.device)  # [B, V + 1]
        hist.scatter_add_(1, torch.where(valid, win, v), torch.ones_like(win, dtype=torch.float32))
        count = hist.gather(1, idx)  # [B, W]
    g = x.gather(1, idx)  # [B, W]
    pen = torch.where(g <= 0, g * repeat[:, None], g / repeat[:, None])
    pen = pen - count * frequency[:, None] - presence[:, None]
    return x.scatter(1, idx, torch.where(count > 0, pen, g))


def modified_logits(logits: torch.Tensor, batch: SamplingBatch, plan: SamplingPlan) -> torch.Tensor:
    """float32 [B, V]: ``logits`` after logit_bias, penalties and grammar masks (the input is never
    modified). A row without a grammar has an all-ones mask: its values come out unchanged."""
    x = logits
    if plan.bias and batch.bias_ids.shape[1]:
        x = apply_logit_bias(x, batch.bias_ids, batch.bias_values)
    if plan.penalties and batch.window.shape[1]:
        x = apply_penalties(
            x,
            batch.window,
            batch.repeat_penalty,
            batch.frequency_penalty,
            batch.presence_penalty,
        )
    if plan.mask and batch.allowed.shape[1]:
        x = apply_allowed(x, logits, unpack_bitmask(batch.allowed, batch.n_vocab))
    return x


def filter_candidates_batch(
    x: torch.Tensor, batch: SamplingBatch, plan: SamplingPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_k -> top_p -> min_p on the biased, penalized ``x`` [B, V], per row.

    Returns (ids [B, K], vals [B, K], keep [B, K] bool): the candidate ids and their logits
    (sorted descending unless ``plan.candidates == WHOLE``, where ids is arange(V) as [1, V]) and
    which survive every filter; row i keeps exactly the tokens of the CPU sampler's
    ``filter_candidates`` (ties at a cut and last-ulp differences of softmax/cumsum aside), and at
    least one. K is plan.candidates (topk), V (SORT, WHOLE). Greedy rows' output is meaningless.
    """
    b, v = x.shape
    if plan.candidates == WHOLE:
        ids = torch.arange(v, device=x.device)[None, :]  # [1, V]
        keep = torch.ones_like(x, dtype=torch.bool)
        if plan.min_p:
            mx = x.max(dim=1, keepdim=True).values  # [B, 1]
            thr = torch.minimum(mx + batch.log_min_p[:, None], mx)  # min_p > 1 keeps the top
            keep = x >= thr
        return ids, x, keep
    if plan.candidates == SORT:
        vals, ids = torch.sort(x, dim=1, descending=True, stable=True)  # [B, V]
    elif plan.candidates > 0:
        vals, ids = torch.topk(x, min(plan.candidates, v), dim=1)  # [B, K] sorted descending
    else:
        raise ValueError(f"filter_candidates_batch: plan has no candidates ({plan})")
    k = vals.shape[1]
    pos = torch.arange(k, device=x.device)[None, :]  # [1, K]
    top_k = batch.top_k[:, None]  # [B, 1]
    keep = (top_k <= 0) | (pos < top_k)  # [B, K]
    if plan.top_p:
        probs = torch.softmax(torch.where(keep, vals, -torch.inf), dim=1)  # [B, K]
        cum = torch.cumsum(probs, dim=1)
        # SeqSampler keeps count(cum < top_p) + 1 tokens (cum is nondecreasing: a prefix)
        n_below = (cum < batch.top_p[:, None]).sum(dim=1, keepdim=True)  # [B, 1]
        keep = keep & (pos <= n_below)
    if plan.min_p:
        thr = vals[:, :1] + batch.log_min_p[:, None]  # [B, 1] float32, as SeqSampler rounds it
        keep = keep & ((vals >= thr) | (pos == 0))
    return ids, vals, keep


def draw(
    ids: torch.Tensor,
    vals: torch.Tensor,
    keep: torch.Tensor,
    batch: SamplingBatch,
) -> torch.Tensor:
    """int64 [B]: per row, a token from softmax(vals / temperature) over the kept candidates,
    by Gumbel-max with the noise of (seed, counter, token id): deterministic, and the same
    whichever candidate list (topk size, sort, whole row) the batch needed."""
    key = row_keys(batch.seed, batch.counter)  # [B]
    u = uniforms(key, ids)  # [B, K]
    gumbel = -torch.log(-torch.log(u))
    score = vals.double() / batch.temperature[:, None] + gumbel  # [B, K]
    score = torch.where(keep, score, -torch.inf)
    j = score.argmax(dim=1, keepdim=True)  # [B, 1]
    if ids.shape[0] == 1 and vals.shape[0] != 1:  # WHOLE: the position is the id
        return j[:, 0]
    return ids.gather(1, j)[:, 0]
