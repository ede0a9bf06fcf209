"""Routed experts (plus an optional sigmoid-gated shared expert) on the device backend, shared by
the hybrid family (qwen3moe, qwen3next, qwen4exp: models/hybrid.py) and llama files with experts
(Mixtral-style: models/dense.py): the router's logits, the route family's top k, the moe family's
experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.cuda.loader import Loader, fuse_rows
from mgserve.cuda.models.base import fused_matmul
from mgserve.cuda.ops.moe import ExpertWeights, SharedExpert
from mgserve.cuda.ops.moe_cuda import MoeCuda
from mgserve.cuda.ops.route import RouteCuda
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend


@dataclass
class Moe:
    router: QuantWeight  # [E, d]
    experts: ExpertWeights
    shexp_gate_up: list[QuantWeight] | None = None  # [2 ff_sh, d] fused, or [gate, up] (fuse_rows)
    shexp_down: QuantWeight | None = None
    shexp_gate_inp: torch.Tensor | None = None  # [d]


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
        m.shexp_gate_up = fuse_rows(
            ld.mat(p + "ffn_gate_shexp.weight", (d, sh)), ld.mat(p + "ffn_up_shexp.weight", (d, sh))
        )
        m.shexp_down = ld.mat(p + "ffn_down_shexp.weight", (sh, d))
        if ld.has(p + "ffn_gate_inp_shexp.weight"):
            m.shexp_gate_inp = ld.vec(p + "ffn_gate_inp_shexp.weight", (d,))
    return m


def moe_ffn(
    b: Backend, w: Moe, h: torch.Tensor, hp: HybridSpec, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """residual + routed experts (softmax top-k) + the sigmoid-gated shared expert, when loaded:
    [N, d]. h is rounded to int8 once for every product that reads it (int8 decode). Where the
    route family fuses the router (``route.fuses``: a decode step with ``fused_decode``), the
    router, the routing and the shared expert's gate are one launch and the down kernel adds the
    shared expert: the same bits as the separate launches."""
    xq = b.linear.quantize(h)
    k, norm = hp.n_expert_used, hp.norm_topk
    fused = _fused(b, h.shape[0], w.router, k)
    if w.shexp_gate_up is None or w.shexp_down is None:
        if fused is not None:
            experts, weights = fused[0].router(h, w.router, k, norm).route
        else:
            experts, weights = b.route.top_k(b.linear.matmul(h, w.router, xq=xq), k, norm)
        return b.moe.experts(h, w.experts, experts, weights, residual=residual, xq=xq)
    side = b.branch.fork()  # the shared expert beside the router and the routed experts
    with side:
        sh = w.shexp_down.k
        g, u = fused_matmul(b, h, w.shexp_gate_up, [sh, sh], xq)
        a, aq = b.act.silu_mul_xq(g, u, xq=b.linear.fused_xq(h.shape[0], sh))
        s = b.linear.matmul(a, w.shexp_down, xq=aq)
    if fused is not None:
        route, moe = fused
        (experts, weights), gate = route.router(h, w.router, k, norm, w.shexp_gate_inp)
        shared = SharedExpert(s, gate, side.join)
        return moe.experts(h, w.experts, experts, weights, residual=residual, xq=xq,
                             shared=shared)  # fmt: skip
    logits = b.linear.matmul(h, w.router, xq=xq)
    experts, weights = b.route.top_k(logits, k, norm)
    y = b.moe.experts(h, w.experts, experts, weights, xq=xq)  # [N, d]
    side.join()
    return b.moe.add_shared(y, s, h, w.shexp_gate_inp, residual)


def _fused(b: Backend, n: int, router: QuantWeight, k: int) -> tuple[RouteCuda, MoeCuda] | None:
    """The route and moe families when n rows take the fused router (``RouteCuda.fuses``)."""
    if isinstance(b.route, RouteCuda) and isinstance(b.moe, MoeCuda):
        if b.route.fuses(n, router, k):
            return b.route, b.moe
    return None
