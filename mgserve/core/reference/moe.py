"""Mixture-of-experts FFN of qwen3moe / qwen3next: softmax router, top-k, SwiGLU experts, and an
optional shared expert scaled by sigmoid(w . x).

Follows llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp) with gating SOFTMAX: probabilities are
the softmax over all experts, the k largest are chosen, their weights (renormalised when ``norm``;
the sum is clamped at 2^-14 like ggml does) scale each expert's down projection. Hugging Face's
``Qwen3NextSparseMoeBlock`` computes the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from mgserve.core.reference import ops, rowwise

MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the top-k sum at the smallest normal f16


@dataclass
class MoeWeights:  # [out, in] float32, per expert along dim 0
    router: torch.Tensor  # [n_expert, n_embd] (ffn_gate_inp)
    gate: torch.Tensor  # [n_expert, n_ff_exp, n_embd] (ffn_gate_exps, or the first half of
    up: torch.Tensor  # [n_expert, n_ff_exp, n_embd]    ffn_gate_up_exps and its second half)
    down: torch.Tensor  # [n_expert, n_embd, n_ff_exp]
    shexp_gate_inp: torch.Tensor | None = None  # [n_embd]: sigmoid gate of the shared expert
    shexp_gate: torch.Tensor | None = None  # [n_ff_shexp, n_embd]
    shexp_up: torch.Tensor | None = None  # [n_ff_shexp, n_embd]
    shexp_down: torch.Tensor | None = None  # [n_embd, n_ff_shexp]


class Routing(NamedTuple):
    experts: torch.Tensor  # [N, k] int64 expert ids, best first
    weights: torch.Tensor  # [N, k] float32


def route(x: torch.Tensor, router: torch.Tensor, k: int, norm: bool) -> Routing:
    """Top-k experts of each token x [N, n_embd] and their weights."""
    return top_k(ops.linear(x, router), k, norm)


def top_k(logits: torch.Tensor, k: int, norm: bool) -> Routing:
    """The k most probable experts of softmax(logits [N, n_expert]) per token, best first, and
    their probabilities (renormalised when ``norm``)."""
    probs = torch.softmax(logits, dim=-1)  # [N, n_expert]
    weights, experts = torch.topk(probs, k, dim=-1)  # [N, k]
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    return Routing(experts, weights)


def experts_ffn(x: torch.Tensor, w: MoeWeights, routing: Routing) -> torch.Tensor:
    """sum_j weight_j * down_e(silu(gate_e x) * up_e x) over each token's chosen experts e = e_j."""
    out = torch.zeros_like(x)  # [N, n_embd]
    flat = routing.experts.flatten()  # [N * k]
    k = routing.experts.shape[1]
    # One product per expert over the tokens that chose it: the cost follows the tokens, not
    # N * E. ops.linear keeps each token's result independent of which others chose the expert.
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero().squeeze(1)  # [M] positions in the flattened [N, k] routing
        tok = slots // k  # [M]
        h = rowwise.silu(ops.linear(x[tok], w.gate[e])) * ops.linear(x[tok], w.up[e])  # [M, ff]
        y = ops.linear(h, w.down[e]) * routing.weights.flatten()[slots, None]  # [M, n_embd]
        out.index_add_(0, tok, y)
    return out


def shared_expert(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """sigmoid(w_g . x) * down(silu(gate x) * up x), or zeros when the model has none."""
    if w.shexp_gate is None or w.shexp_up is None or w.shexp_down is None:
        return torch.zeros_like(x)
    h = rowwise.silu(ops.linear(x, w.shexp_gate)) * ops.linear(x, w.shexp_up)  # [N, ff_shexp]
    y = ops.linear(h, w.shexp_down)  # [N, n_embd]
    if w.shexp_gate_inp is not None:
        y = y * rowwise.sigmoid(ops.linear(x, w.shexp_gate_inp[None]))  # [N, 1] gate
    return y


def moe_ffn(x: torch.Tensor, w: MoeWeights, k: int, norm: bool) -> torch.Tensor:
    """The whole MoE block on already-normalised tokens x [N, n_embd] -> [N, n_embd]."""
    return experts_ffn(x, w, route(x, w.router, k, norm)) + shared_expert(x, w)
