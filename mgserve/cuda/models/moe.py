"""Routed experts (plus an optional sigmoid-gated shared expert) on the device backend, shared by
the hybrid family (qwen3moe, qwen3next, qwen4exp: models/hybrid.py) and llama files with experts
(Mixtral-style: models/dense.py): the router's logits, the route family's top k, the moe family's
experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.reference import rowwise
from mgserve.cuda.loader import Loader
from mgserve.cuda.ops.moe import ExpertWeights
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend


@dataclass
class Moe:
    router: QuantWeight  # [E, d]
    experts: ExpertWeights
    shexp_gate: QuantWeight | None = None
    shexp_up: QuantWeight | None = None
    shexp_down: QuantWeight | None = None
    shexp_gate_inp: QuantWeight | None = None  # [1, d]


def load_moe(ld: Loader, il: int, d: int, hp: HybridSpec) -> Moe:
    """Layer ``il``'s routed experts (separate or fused gate/up) and shared expert, if any."""
    p, ff, ne = f"blk.{il}.", hp.n_ff_exp, hp.n_expert
    if ld.has(p + "ffn_gate_up_exps.weight"):
        gate_up = ld.mat(p + "ffn_gate_up_exps.weight", (d, 2 * ff, ne))
        gate = up = None
    else:
        gate_up = None
        gate = ld.mat(p + "ffn_gate_exps.weight", (d, ff, ne))
        up = ld.mat(p + "ffn_up_exps.weight", (d, ff, ne))
    down = ld.mat(p + "ffn_down_exps.weight", (ff, d, ne))
    m = Moe(
        router=ld.mat(p + "ffn_gate_inp.weight", (d, ne)),
        experts=ExpertWeights(gate, up, gate_up, down, ne, ff),
    )
    if hp.n_ff_shexp:
        sh = hp.n_ff_shexp
        m.shexp_gate = ld.mat(p + "ffn_gate_shexp.weight", (d, sh))
        m.shexp_up = ld.mat(p + "ffn_up_shexp.weight", (d, sh))
        m.shexp_down = ld.mat(p + "ffn_down_shexp.weight", (sh, d))
        if ld.has(p + "ffn_gate_inp_shexp.weight"):
            m.shexp_gate_inp = ld.mat(p + "ffn_gate_inp_shexp.weight", (d,))
    return m


def moe_ffn(b: Backend, w: Moe, h: torch.Tensor, hp: HybridSpec) -> torch.Tensor:
    """Routed (softmax top-k) plus, when loaded, the sigmoid-gated shared expert: [N, d]."""
    experts, weights = b.route.top_k(b.linear.matmul(h, w.router), hp.n_expert_used, hp.norm_topk)
    y = b.moe.experts(h, w.experts, experts, weights)  # [N, d]
    if w.shexp_gate is not None and w.shexp_up is not None and w.shexp_down is not None:
        g = b.linear.matmul(h, w.shexp_gate)
        u = b.linear.matmul(h, w.shexp_up)
        s = b.linear.matmul(b.act.silu_mul(g, u), w.shexp_down)
        if w.shexp_gate_inp is not None:
            s = s * rowwise.sigmoid(b.linear.matmul(h, w.shexp_gate_inp))
        y = y + s
    return y
