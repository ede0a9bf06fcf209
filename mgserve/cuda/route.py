"""MoE routing of the device backend: softmax over each token's router logits, the top k experts,
and their weights (renormalised to sum 1 when the model says so).

``RouteTorch.route`` is ``mgserve.core.reference.moe.route`` after its router matmul, op for op
(bit-identical on the CPU given the same logits). ``RouteCuda.route`` runs ``kernels/route.cu``:
one warp per token does the whole routing in one launch (instead of softmax, topk, sum, clamp and
divide as five), with equal probabilities going to the lower expert id; torch.topk leaves that
order unspecified, so the two agree except where probabilities tie. Both are static-shape and
sync-free (decode steps capture them into CUDA graphs).

The lead's MoE block calls ``experts, weights = ops.route(ops.linear(h, w.router), k, norm)``
and hands both to ``ops.moe_experts``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from mgserve.core.reference.moe import _MIN_WEIGHT_SUM
from mgserve.cuda.kbase import CudaBase, TorchBase

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


class RouteTorch(TorchBase):
    """Routing in plain PyTorch on the logits' device."""

    def route(self, logits: torch.Tensor, k: int, norm: bool) -> Route:
        """logits [N, E] float32 -> the top ``k`` experts of softmax(logits) per token, best
        first, and their probabilities (divided by their sum, clamped at 2^-14, when ``norm``)."""
        _check_route(logits, k)
        probs = torch.softmax(logits, dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, k, dim=-1)  # [N, k]
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)
        return Route(experts.to(torch.int32), weights)


class RouteCuda(CudaBase, RouteTorch):
    """Routing with the route.cu kernel (the torch version past 512 experts or k > 32)."""

    def route(self, logits: torch.Tensor, k: int, norm: bool) -> Route:
        _check_route(logits, k)
        n, e = logits.shape
        if e > ROUTE_MAX_EXPERTS or k > ROUTE_MAX_K or logits.device != self.device:
            return super().route(logits, k, norm)
        logits = logits.contiguous()
        experts = torch.empty((n, k), dtype=torch.int32, device=self.device)
        weights = torch.empty((n, k), dtype=torch.float32, device=self.device)
        if n:
            self.launch(
                self.kernel(ROUTE_SOURCE, "moe_route"),
                -(-n // ROUTE_WARPS),
                ROUTE_WARPS * 32,
                logits.data_ptr(),
                experts.data_ptr(),
                weights.data_ptr(),
                np.int32(n),
                np.int32(e),
                np.int32(k),
                np.int32(1 if norm else 0),
                np.float32(_MIN_WEIGHT_SUM),
            )
        return Route(experts, weights)
