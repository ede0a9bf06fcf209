"""The route family: MoE routing, softmax over each token's router logits, the top k experts,
and their weights (renormalised to sum 1 when the model says so).

``RouteTorch.top_k`` is ``mgserve.core.reference.moe.top_k`` (the reference's routing after its
router matmul) with int32 ids. ``RouteCuda.top_k`` runs ``kernels/route.cu``:
one warp per token does the whole routing in one launch (instead of softmax, topk, sum, clamp and
divide as five), with equal probabilities going to the lower expert id; torch.topk leaves that
order unspecified, so the two agree except where probabilities tie. Both are static-shape and
sync-free (decode steps capture them into CUDA graphs).

A MoE block calls ``experts, weights = backend.route.top_k(logits, k, norm)`` on its router's
logits and hands both to ``backend.moe.experts``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from mgserve.core.reference import moe
from mgserve.core.reference.moe import MIN_WEIGHT_SUM
from mgserve.cuda.launch import Kernels

ROUTE_SOURCE = "route.cu"
ROUTE_WARPS = 4  # ROUTE_WARPS in route.cu: tokens per CTA, one warp each
ROUTE_MAX_EXPERTS = 512  # 32 * ROUTE_PER_LANE in route.cu
ROUTE_MAX_K = 32  # one lane keeps each chosen expert


class Route(NamedTuple):
    experts: torch.Tensor  # [N, k] int32 expert ids, best first
    weights: torch.Tensor  # [N, k] float32


def _check_route(logits: torch.Tensor, k: int) -> None:
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {list(logits.shape)}, expected [N, n_expert]")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in 1..{logits.shape[1]} (the experts), got {k}")


class RouteTorch:
    """Routing in plain PyTorch on the logits' device."""

    def top_k(self, logits: torch.Tensor, k: int, norm: bool) -> Route:
        """logits [N, E] float32 -> the top ``k`` experts of softmax(logits) per token, best
        first, and their probabilities (divided by their sum, clamped at 2^-14, when ``norm``)."""
        _check_route(logits, k)
        experts, weights = moe.top_k(logits, k, norm)
        return Route(experts.to(torch.int32), weights)


class RouteCuda:
    """Routing with the route.cu kernel (the torch version past 512 experts or k > 32)."""

    def __init__(self, kernels: Kernels, fallback: RouteTorch) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device

    def top_k(self, logits: torch.Tensor, k: int, norm: bool) -> Route:
        _check_route(logits, k)
        n, e = logits.shape
        if e > ROUTE_MAX_EXPERTS or k > ROUTE_MAX_K or logits.device != self.device:
            return self.fallback.top_k(logits, k, norm)
        logits = logits.contiguous()
        experts = torch.empty((n, k), dtype=torch.int32, device=self.device)
        weights = torch.empty((n, k), dtype=torch.float32, device=self.device)
        if n:
            self.kernels.launch(
                self.kernels.kernel(ROUTE_SOURCE, "moe_route"),
                -(-n // ROUTE_WARPS),
                ROUTE_WARPS * 32,
                logits.data_ptr(),
                experts.data_ptr(),
                weights.data_ptr(),
                np.int32(n),
                np.int32(e),
                np.int32(k),
                np.int32(1 if norm else 0),
                np.float32(MIN_WEIGHT_SUM),
            )
        return Route(experts, weights)
