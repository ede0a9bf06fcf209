"""The route family: MoE routing, softmax over each token's router logits, the top k experts,
and their weights (renormalised to sum 1 when the model says so).

``RouteTorch.top_k`` is ``mgserve.core.reference.moe.top_k`` (the reference's routing after its
router matmul) with int32 ids. ``RouteCuda.top_k`` runs ``kernels/route.cu``:
one warp per token does the whole routing in one launch (instead of softmax, topk, sum, clamp and
divide as five), with equal probabilities going to the lower expert id; torch.topk leaves that
order unspecified, so the two agree except where probabilities tie. Both are static-shape and
sync-free (decode steps capture them into CUDA graphs).

A MoE block calls ``experts, weights = backend.route.top_k(logits, k, norm)`` on its router's
logits and hands both to ``backend.moe.experts``. In a decode step of the CUDA backend with
``fused_decode`` (``RouteCuda.fuses``) it calls ``RouteCuda.router`` instead: the router's
product, the routing and the shared expert's gate in one launch (route.cu's matvec_route, which
computes the logits with matvec.cu's code and routes them in its last CTA, or with ``split`` in
each token group's last CTA), the same bits as the matvec, ``top_k`` and ``moe.add_shared``'s
gate.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mgserve.core.reference import moe
from mgserve.core.reference.moe import MIN_WEIGHT_SUM
from mgserve.cuda.checks import check_cuda, check_vec4, check_weight
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.linear_tuning import (
    MATVEC_TOKEN_BUCKETS,
    MATVEC_WARPS_PER_CTA,
    MAX_MATVEC_TOKENS,
    MatvecTuning,
    token_bucket,
)
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.ops.linear_cuda import LinearCuda
    from mgserve.cuda.tickets import Tickets

ROUTE_SOURCE = "route.cu"
ROUTE_WARPS = 4  # ROUTE_WARPS in route.cu: tokens per CTA, one warp each
ROUTE_MAX_EXPERTS = 512  # 32 * ROUTE_PER_LANE in route.cuh
ROUTE_MAX_K = 32  # one lane keeps each chosen expert
ROUTER_TYPES = frozenset({"F32", "F16", "BF16"})  # route.cu's matvec_route_<T> formats
# the fused router's product with ``lean`` (the default): a row a warp for any token count, and
# ``RouteCuda.unroll`` runs' loads in flight a lane (RUN_UNROLL; 8: all of them up to 2048
# inputs): matvec.cu's bits (a row's sums do not depend on these)
LEAN_TUNING = MatvecTuning(1, 1, 8)
LEAN_DEFINES = (("ROUTE_REDUX", "1"),)  # and the top k by warp reductions (route.cuh)
BATCH_DEFINES = (("RUN_BATCH", "1"),)  # route.batch (matvec.cuh)
# route.unroll at most: batches of 12 runs take 255 registers in the one-token F16 / BF16
# kernels, of 16 they spill (144-272 B; NVRTC 13.0, sm_90)
MAX_UNROLL = 12


class Route(NamedTuple):
    experts: torch.Tensor  # [N, k] int32 expert ids, best first
    weights: torch.Tensor  # [N, k] float32


class Routed(NamedTuple):
    """``RouteCuda.router``'s results: the route, and the shared expert's gates
    sigmoid(h . gate_inp) [N] float32 (None without a gate)."""

    route: Route
    gate: torch.Tensor | None


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
    """Routing with the route.cu kernel (the torch version past 512 experts or k > 32).
    ``linear``: the backend's linear family, whose matvec tuning and switches the fused router
    follows, and ``tickets`` its counters (``fuses``, ``router``); without both there is no
    fused router."""

    def __init__(
        self, kernels: Kernels, fallback: RouteTorch, linear: LinearCuda | None = None,
        tickets: Tickets | None = None,
    ) -> None:  # fmt: skip
        self.kernels, self.fallback, self.linear = kernels, fallback, linear
        self.device = kernels.device
        self.tickets = tickets
        self.fused = True  # the switch (bench model --set route.fused=false)
        # the fused router's lean kernels (LEAN_TUNING, LEAN_DEFINES): the same results, five
        # sessions' decode +1.3% on the H100 (bench model --paired 5 --toggle route.lean,
        # 2026-12-07; one session +0.5%, within the noise)
        self.lean = True
        # the lean product's runs in flight a lane (RUN_UNROLL, 1..12) and, with ``batch``, its
        # one-token loop in batches of that many runs, every load issued before any is used
        # (matvec.cuh's RUN_BATCH; the unrolled loop does a trip count's remainder a run at a
        # time, and ptxas kept about four runs in flight of 8): the same bits. 8 covers a
        # 2048-wide router row, qwen4exp's 2560 take 10 (bench model --set route.unroll=10
        # --toggle route.batch: not measured yet)
        self._unroll = LEAN_TUNING.unroll
        self.batch = False
        # 2..8 tokens in groups of split_tokens (grid y; route.cu): each warp does a group's
        # serial work, not all tokens', and the groups route in parallel; the same bits. Five
        # sessions' decode on the H100 (bench model --paired 5 --toggle route.split, 2026-12-07):
        # groups of 1 +5.2% at depth 32768; groups of 2 +4.0% / +4.6% at 32768 / 131072 (the
        # group: split_tokens, below; on against off, by the medians)
        self.split = True
        self._split_tokens = 1

    @property
    def unroll(self) -> int:
        """The lean router's runs a lane loads before it uses any (``lean``'s RUN_UNROLL)."""
        return self._unroll

    @unroll.setter
    def unroll(self, n: int) -> None:
        if type(n) is not int or not 1 <= n <= MAX_UNROLL:  # a bool is refused too
            raise ValueError(f"route.unroll must be an int in 1..{MAX_UNROLL}, got {n!r}")
        self._unroll = n

    @property
    def split_tokens(self) -> int:
        """Tokens a group with ``split`` (a token bucket of the matvec kernels: 1, 2, 4 or 8)."""
        return self._split_tokens

    @split_tokens.setter
    def split_tokens(self, n: int) -> None:
        if type(n) is not int or n not in MATVEC_TOKEN_BUCKETS:  # a bool is refused too
            raise ValueError(f"route.split_tokens must be one of {MATVEC_TOKEN_BUCKETS}, got {n!r}")
        self._split_tokens = n

    def fuses(self, n: int, router: QuantWeight, k: int) -> bool:
        """Whether ``router`` runs for n rows: a decode step's rows with ``fused_decode`` (and
        ``self.fused``), in one launch of at most MAX_MATVEC_TOKENS tokens, of a router format,
        expert count and k that route.cu's kernels take, with a counter for the router."""
        lin = self.linear
        return (
            lin is not None
            and self.fused
            and lin.fused_decode
            and 1 <= n <= MAX_MATVEC_TOKENS
            and lin.path.decode_kernels(n)
            and router.type_name in ROUTER_TYPES
            and router.rows <= ROUTE_MAX_EXPERTS
            and k <= min(ROUTE_MAX_K, router.rows)
            and self._ticket(router) is not None
        )

    def _ticket(self, router: QuantWeight) -> int | None:
        """The address of ``router``'s counters (tickets.py: one a token group, so
        MAX_MATVEC_TOKENS), or None: no counters."""
        if self.tickets is None:
            return None
        return self.tickets.at(router.data.data_ptr(), MAX_MATVEC_TOKENS)

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

    def router(
        self, h: torch.Tensor, router: QuantWeight, k: int, norm: bool,
        gate_inp: torch.Tensor | None = None,
    ) -> Routed:  # fmt: skip
        """h [N, d] float32 (N <= 8) -> the route of ``top_k(h @ router^T, k, norm)`` and, with
        ``gate_inp`` [d], the shared expert's gates sigmoid(h . gate_inp) [N], in one launch
        (``fuses`` must hold): the bits of the matvec, ``top_k`` and ``moe.add_shared``'s gate."""
        if not self.fuses(h.shape[0] if h.dim() == 2 else 0, router, k):
            raise ValueError(f"route.router: no fused router for {router.name} (see fuses)")
        assert self.linear is not None and self.tickets is not None  # fuses
        ticket = self._ticket(router)
        check_weight(router, self.device)
        n, d = h.shape
        if d != router.k:
            raise ValueError(f"{router.name}: h has {d} columns, the router takes {router.k}")
        check_vec4("h", h, self.device, torch.float32)  # matvec.cuh reads float4
        if gate_inp is not None:
            check_cuda("gate_inp", gate_inp, self.device, torch.float32)
            if tuple(gate_inp.shape) != (d,):
                raise ValueError(f"gate_inp has shape {list(gate_inp.shape)}, expected [{d}]")
        e = router.rows
        logits = torch.empty(n, e, dtype=torch.float32, device=self.device)
        experts = torch.empty((n, k), dtype=torch.int32, device=self.device)
        weights = torch.empty((n, k), dtype=torch.float32, device=self.device)
        gate = None if gate_inp is None else torch.empty(n, dtype=torch.float32, device=self.device)
        tuning = self.linear.tuning
        if self.lean:
            tuning = dataclasses.replace(LEAN_TUNING, unroll=self.unroll)
        elif self.batch or self.unroll != LEAN_TUNING.unroll:  # (they would change nothing)
            raise ValueError("route.batch and route.unroll are the lean router's (route.lean)")
        lean = LEAN_DEFINES + (BATCH_DEFINES if self.batch else ()) if self.lean else ()
        defines = tuning.defines() + lean + self.tickets.defines
        bucket = token_bucket(min(n, self.split_tokens) if self.split else n)
        per_cta = tuning.rows_per_cta(bucket)
        # x: the rows' CTAs and the gates' one; y: the groups of `bucket` tokens (route.cu)
        grid = (-(-e // per_cta) + (0 if gate_inp is None else 1), -(-n // bucket))
        self.kernels.launch(
            self.kernels.kernel(
                ROUTE_SOURCE, f"matvec_route_{router.type_name}_t{bucket}", defines
            ),
            grid,
            32 * MATVEC_WARPS_PER_CTA,
            router.data.data_ptr(),
            h.data_ptr(),
            logits.data_ptr(),
            np.int32(e),
            np.int32(d),
            np.int32(n),
            experts.data_ptr(),
            weights.data_ptr(),
            np.int32(k),
            np.int32(1 if norm else 0),
            np.float32(MIN_WEIGHT_SUM),
            0 if gate_inp is None else gate_inp.data_ptr(),
            0 if gate is None else gate.data_ptr(),
            ticket,
        )
        return Routed(Route(experts, weights), gate)
