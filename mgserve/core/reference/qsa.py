"""QSA block-sparse attention (qwen4exp full-attention layers): a small indexer picks, for each
query, the best ``budget / r`` complete blocks of ``r`` tokens, and the query attends only to those
blocks' tokens plus its own incomplete block (the tail, always attended).

Follows HF ``Qwen4ExpTextQSAIndexer`` (the exact reference):
- token keys are raw projections (``indexer.k_proj``); a block's key is the mean of its r raw
  keys, then RMSNorm (``indexer.k_norm``), then RoPE at the block's first position. A block key
  depends only on its own tokens, so sessions cache it once the block is complete
  (``Qwen4ExpState.blocks``) and a decode step pools at most one new block;
- queries: ``indexer.q_proj`` per head, RMSNorm, RoPE at the token's position;
- score(block) = sum_h relu(q_h . k_block) / sqrt(D); the top ``budget / r`` of the query's
  complete blocks are selected. While a query has no more complete blocks than that, it selects
  all of them: QSA is then exactly dense causal attention.
llama.cpp's graph (src/models/qwen4exp.cpp ``build_qsa_top_k``) ranks cells instead of blocks
with ``budget + r - 1`` winners, so when the tail is shorter than r - 1 it also admits a few
cells of the next-best block; see tests/data/make_qwen4exp_reference.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.reference import ops, rowwise


@dataclass
class IndexerWeights:  # [out, in] float32
    q_proj: torch.Tensor  # [n_heads * D, n_embd]
    k_proj: torch.Tensor  # [D, n_embd] (one key head)
    q_norm: torch.Tensor  # [D] (1 + w)
    k_norm: torch.Tensor  # [D]


def index_queries(
    h: torch.Tensor, pos: torch.Tensor, w: IndexerWeights, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, H_idx, D], raw keys [N, D]
    """Token-wise: normalised, rotated indexer queries and the raw (unpooled) keys."""
    n, dim = h.shape[0], w.k_norm.shape[0]
    q = ops.rms_norm(ops.linear(h, w.q_proj).view(n, -1, dim), w.q_norm, spec.rms_eps)
    q = ops.model_rope(q, pos, spec)
    return q, ops.linear(h, w.k_proj)


def pool_blocks(
    raw: torch.Tensor, first: int, w: IndexerWeights, spec: ModelSpec
) -> torch.Tensor:  # [B, D]
    """Keys of the complete blocks raw [B, r, D] (raw token keys), the first one being block
    ``first``: mean, RMSNorm, RoPE at each block's first position."""
    b, r, dim = raw.shape
    pooled = ops.rms_norm(rowwise.sum_in_order(raw, 1) / raw.shape[1], w.k_norm, spec.rms_eps)
    starts = (first + torch.arange(b)) * r  # [B]
    return ops.model_rope(pooled[:, None], starts, spec)[:, 0]


def select(
    q: torch.Tensor,  # [H_idx, D] one query's indexer heads
    p: int,  # its position
    blocks: torch.Tensor,  # [>= (p + 1) // r, D] the session's block keys
    r: int,
    budget: int,  # tokens of whole blocks
    stable: bool = False,
) -> torch.Tensor:  # [S'] int64 ascending positions the query attends to
    """The query's selected blocks' positions and its tail, ascending.

    relu makes every block whose heads all score negative score exactly 0, so ties at the cut
    happen. ``stable=False`` leaves them to ``torch.topk`` as HF does (on the CPU it matches HF's
    choice); ``stable=True`` gives them to the earlier block, the rule the device path uses on
    every device (mgserve/cuda/ops/qsa.py)."""
    complete = (p + 1) // r
    top = budget // r
    if complete <= top:
        return torch.arange(p + 1)  # every block: dense causal attention
    scores = q @ blocks[:complete].T  # [H_idx, complete]
    scores = torch.relu(scores.T).sum(dim=-1) / math.sqrt(q.shape[-1])  # [complete]
    if stable:
        order = torch.sort(scores, descending=True, stable=True).indices
    else:
        order = scores.topk(top, dim=0).indices
    chosen = order[:top].sort().values  # [top]
    cells = (chosen[:, None] * r + torch.arange(r)).flatten()  # [top * r]
    return torch.cat((cells, torch.arange(complete * r, p + 1)))


def attend_selected(
    q: torch.Tensor,  # [H, Dh] one query
    keys: torch.Tensor,  # [S', Hkv, Dh] the selected positions' keys
    values: torch.Tensor,  # [S', Hkv, Dh]
    scale: float,
) -> torch.Tensor:  # [H * Dh]
    """Softmax attention of one query over exactly the rows it selected (GQA)."""
    n_head, n_kv = q.shape[0], keys.shape[1]
    k = keys.repeat_interleave(n_head // n_kv, dim=1)  # [S', H, Dh]
    v = values.repeat_interleave(n_head // n_kv, dim=1)
    probs = torch.softmax(torch.einsum("hd,shd->hs", q, k) * scale, dim=-1)  # [H, S']
    return torch.einsum("hs,shd->hd", probs, v).flatten()
