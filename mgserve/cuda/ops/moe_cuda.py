"""``MoeCuda``: the MoE family on kernels, in two regimes chosen by the number of tokens N.

- decode (N <= 8): two kernels (moe.cu, or moe_q8.cu with ``int8``) read only the selected
  experts' rows, with expert ids read on the device: no host sync, so a step captures into a
  CUDA graph, and each token's result is bitwise independent of the rest of the batch;
- prefill (N > 8): ``MoePrefillCuda.grouped`` (moe_prefill_cuda.py): pairs sorted by expert on
  the device, grouped tensor-core products read from the GGUF blocks (qgemm.cu), per-pair
  results summed over j in a fixed order; batch-invariant, no host sync. With
  ``cublas_prefill``, the older bucketed path instead (``moe_prefill``, moe_prefill.py: one host
  sync, experts dequantized to f16, padded batched cuBLAS products; not batch-invariant), kept to
  compare with and to fall back on.

The residual is added as the down kernel writes each output (decode); ``add_shared`` is one kernel
(moe_shared.cu: one CTA per token, the gate's dot product reduced in a fixed order). A decode step
with ``fused_decode`` hands ``experts`` the shared expert's output and gates instead
(``SharedExpert``: the gates from ``route.router``), and the down kernel adds them as it writes
each output, as ``add_shared`` would: the same bits, one launch fewer.
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.checks import check_cuda, check_weight, vec4_input
from mgserve.cuda.launch import MAX_GRID_Y, Kernels
from mgserve.cuda.ops.linear_cuda import LinearCuda
from mgserve.cuda.ops.linear_tuning import MAX_MATVEC_TOKENS, Q8Activations
from mgserve.cuda.ops.moe import (
    ExpertWeights,
    MoeTorch,
    SharedExpert,
    check_moe,
    check_residual,
    check_shared,
)
from mgserve.cuda.ops.moe_prefill import moe_prefill
from mgserve.cuda.ops.moe_prefill_cuda import MoePrefillCuda
from mgserve.cuda.tickets import Tickets
from mgserve.cuda.weights import QuantWeight

MOE_SOURCE = "moe.cu"
MOE_Q8_SOURCE = "moe_q8.cu"
SHARED_SOURCE = "moe_shared.cu"
SHARED_THREADS = 256  # threads per CTA of moe_add_shared_f32 (the gate's sum order: fixed)
MOE_WARPS = 4  # MOE_WARPS in kernels/moe_decode.cuh
MOE_Q8_TYPES = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0"})  # expert formats of moe_q8.cu
MOE_ROWS = (1, 1)  # MoeCuda's default rows per warp: gate/up, down


def moe_defines(rows: tuple[int, int]) -> tuple[tuple[str, str], ...]:
    """The -D values of moe.cu and moe_q8.cu (GU_ROWS, DOWN_ROWS of moe_decode.cuh)."""
    return (("GU_ROWS", str(rows[0])), ("DOWN_ROWS", str(rows[1])))


class MoeCuda:
    """MoE experts on kernels (see the module docstring). ``int8``: decode products of
    MOE_Q8_TYPES experts round the activations to int8 per 32 values (relative error ~1e-3).
    ``prefill_exact``: prompt chunks run the torch version (fp32, every expert; tests).
    ``cublas_prefill``: prompt chunks take the bucketed cuBLAS path (module docstring).
    ``moe_rows``: rows per warp of the gate/up and down kernels (GU_ROWS / DOWN_ROWS of
    moe_decode.cuh), for tuning. ``tickets``: counters with which the int8 gate/up kernel can
    round h for the int8 down kernel itself (``round_h``, off: slower than the quantize launch)."""

    def __init__(
        self,
        kernels: Kernels,
        fallback: MoeTorch,
        linear: LinearCuda,
        moe_rows: tuple[int, int] = MOE_ROWS,
        tickets: Tickets | None = None,
    ) -> None:
        if len(moe_rows) != 2 or not all(1 <= r <= 8 for r in moe_rows):
            raise ValueError(f"moe_rows must be two row counts in 1..8, got {moe_rows}")
        self.kernels, self.fallback, self.linear = kernels, fallback, linear
        self.device = kernels.device
        self.prefill = MoePrefillCuda(kernels, linear)
        self.int8 = False
        self.prefill_exact = False
        self.cublas_prefill = False
        self.moe_rows = moe_rows
        self._defines = moe_defines(moe_rows)
        self.tickets = tickets  # the int8 gate/up kernel's counters (rounding h itself)
        # the int8 gate/up rounds h itself (tickets) instead of a quantize launch: the same bits,
        # one launch fewer a layer, but each CTA's fence and ticket cost more than the launch
        # (H100, 2026-12-06: +0.11 / +0.55 ms a step for 1 / 5 sessions): off (--set
        # moe.round_h=true)
        self.round_h = False
        # add_shared's decode rows cut into parts, a CTA each, instead of one CTA a row (the
        # same bits: tests/cuda/test_glue.py; bench model --paired R --toggle moe.shared_parts)
        self.shared_parts = True

    def experts(
        self,
        x: torch.Tensor,
        w: ExpertWeights,
        experts: torch.Tensor,
        weights: torch.Tensor,
        *,
        residual: torch.Tensor | None = None,
        xq: Q8Activations | None = None,
        shared: SharedExpert | None = None,
    ) -> torch.Tensor:
        """residual + sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x), e = experts[:, j].

        x [N, d] fp32, experts [N, kk] int32 (int64 is converted on the device; ids outside
        [0, E) are clamped), weights [N, kk] fp32, residual [N, d] or None -> [N, d] fp32.
        ``xq``: x as ``linear.quantize`` rounded it, read by the int8 gate/up kernel.
        ``shared``: a decode step's shared expert, added as ``add_shared`` adds it (decode rows
        of at most MAX_MATVEC_TOKENS tokens only).
        """
        check_moe(x, w, experts, weights)
        check_residual(residual, x)
        for m in (w.gate, w.up, w.gate_up, w.down):
            if m is not None:
                check_weight(m, self.device)
        if -(-max(w.n_ff, w.n_embd) // MOE_WARPS) > 65535:
            raise ValueError(f"moe.experts: {max(w.n_ff, w.n_embd)} rows exceed the kernels' grid")
        x = vec4_input("x", x, self.device)
        if experts.dtype != torch.int32:
            experts = experts.to(torch.int32)
        experts, weights = experts.contiguous(), weights.contiguous()
        check_cuda("experts", experts, self.device, torch.int32)
        check_cuda("weights", weights, self.device, torch.float32)
        n = x.shape[0]
        if shared is not None:
            if not (0 < n <= MAX_MATVEC_TOKENS and self.linear.path.decode_kernels(n)):
                raise ValueError(
                    f"moe.experts: the shared expert is added to decode rows of 1.."
                    f"{MAX_MATVEC_TOKENS} tokens only, got {n} rows"
                )
            check_cuda("shared.out", shared.out, self.device, torch.float32)
            if shared.out.shape != x.shape:
                raise ValueError(f"shared.out has shape {list(shared.out.shape)}, expected "
                                 f"{list(x.shape)}")  # fmt: skip
            if shared.gate is not None:
                check_cuda("shared.gate", shared.gate, self.device, torch.float32)
                if tuple(shared.gate.shape) != (n,):
                    raise ValueError(f"shared.gate has shape {list(shared.gate.shape)}, "
                                     f"expected [{n}]")  # fmt: skip
        if n > MAX_MATVEC_TOKENS and self.prefill_exact:
            return self.fallback.experts(x, w, experts, weights, residual=residual)
        if n == 0:
            return torch.zeros_like(x)
        if self.linear.path.decode_kernels(n):  # a decode step: 8 tokens at a time
            if residual is not None:
                check_cuda("residual", residual, self.device, torch.float32)
            if n <= MAX_MATVEC_TOKENS:
                return self._decode(x, w, experts, weights, residual, xq, shared)
            step = MAX_MATVEC_TOKENS
            return torch.cat([
                self._decode(
                    x[r0 : r0 + step], w, experts[r0 : r0 + step], weights[r0 : r0 + step],
                    None if residual is None else residual[r0 : r0 + step], None, None,
                )
                for r0 in range(0, n, step)
            ])  # fmt: skip
        if self.cublas_prefill:
            y = moe_prefill(self.prefill, x, w, experts, weights)
        else:
            y = self.prefill.grouped(x, w, experts, weights)
        return y if residual is None else residual + y

    def _decode(
        self, x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor,
        residual: torch.Tensor | None, xq: Q8Activations | None, shared: SharedExpert | None,
    ) -> torch.Tensor:  # fmt: skip
        gate_w, up, expert_rows = w.gate_up_storage()
        gate = gate_w.data.data_ptr()
        n, kk = experts.shape
        d, e, ff = w.n_embd, w.n_expert, w.n_ff
        stream = self.kernels.stream()
        h = torch.empty(n, kk, ff, dtype=torch.float32, device=self.device)  # [N, kk, ff]
        out = torch.empty(n, d, dtype=torch.float32, device=self.device)  # [N, d]
        gt, dt = w.gate_type, w.down.type_name
        # pairs / tokens on the fast grid axis, row tiles on y (see moe.cu)
        grid = (n * kk, -(-ff // (MOE_WARPS * self.moe_rows[0])))
        int8_down = self.int8 and dt in MOE_Q8_TYPES
        hq: Q8Activations | None = None
        if self.int8 and gt in MOE_Q8_TYPES:
            if xq is None:
                xq = self.linear.q8.quantize(x, stream)
            defines = self._defines + (() if self.tickets is None else self.tickets.defines)
            kernel = self.kernels.kernel(MOE_Q8_SOURCE, f"moe_q8_gate_up_{gt}", defines)
            act: tuple[int, ...] = (xq.q.data_ptr(), xq.d.data_ptr())
            rounds = self._rounds_h(gate_w, n * kk, ff, kk) if int8_down else None
            if rounds is not None:  # the kernel rounds h to int8 itself (moe_gate_up_warp)
                hq = self.linear.q8.empty(n * kk, ff)
            tail: tuple[object, ...] = (
                experts.data_ptr(), h.data_ptr(),
                0 if hq is None else hq.q.data_ptr(), 0 if hq is None else hq.d.data_ptr(),
                0 if rounds is None else rounds,
            )  # fmt: skip
        else:
            kernel = self.kernels.kernel(MOE_SOURCE, f"moe_gate_up_{gt}", self._defines)
            act = (x.data_ptr(),)
            tail = (experts.data_ptr(), h.data_ptr())
        self.kernels.launch(
            kernel, grid, 32 * MOE_WARPS, gate, up, np.int64(expert_rows), *act, *tail,
            np.int32(kk), np.int32(ff), np.int32(d), np.int32(e),
        )  # fmt: skip
        grid = (n, -(-d // (MOE_WARPS * self.moe_rows[1])))
        if int8_down:
            if hq is None:
                hq = self.linear.q8.quantize(h.view(n * kk, ff), stream)
            kernel = self.kernels.kernel(MOE_Q8_SOURCE, f"moe_q8_down_{dt}", self._defines)
            act = (hq.q.data_ptr(), hq.d.data_ptr())
        else:
            kernel = self.kernels.kernel(MOE_SOURCE, f"moe_down_{dt}", self._defines)
            act = (h.data_ptr(),)
        if shared is not None:
            shared.ready()  # the side chain's output, before the kernel that reads it
        self.kernels.launch(
            kernel,
            grid,
            32 * MOE_WARPS,
            w.down.data.data_ptr(),
            np.int64(d),
            *act,
            experts.data_ptr(),
            weights.data_ptr(),
            out.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            0 if shared is None else shared.out.data_ptr(),
            0 if shared is None or shared.gate is None else shared.gate.data_ptr(),
            np.int32(kk),
            np.int32(d),
            np.int32(ff),
            np.int32(e),
        )
        return out

    def _rounds_h(self, gate: QuantWeight, rows: int, ff: int, kk: int) -> int | None:
        """The counters (``gate``'s: tickets.py) with which the int8 gate/up kernel rounds h
        [rows, ff] itself, or None (a quantize launch instead): with ``fused_decode``, ff in
        groups of 32 that each CTA's rows tile, and counters left."""
        per_cta = MOE_WARPS * self.moe_rows[0]
        if not (self.round_h and self.linear.fused_decode) or self.tickets is None:
            return None
        if ff % 32 or 32 % per_cta:
            return None
        # a run for the largest decode group at once (not one more for each size on the way)
        return self.tickets.at(gate.data.data_ptr(), max(rows, MAX_MATVEC_TOKENS * kk) * ff // 32)

    def add_shared(
        self,
        routed: torch.Tensor,
        shared: torch.Tensor,
        h: torch.Tensor,
        gate: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_shared(routed, shared, h, gate, residual)
        named = (("routed", routed), ("shared", shared), ("h", h), ("gate", gate))
        for name, t in (*named, ("residual", residual)):
            if t is not None:
                check_cuda(name, t, self.device, torch.float32)
        n, d = routed.shape
        out = torch.empty_like(routed)  # [N, d]
        # a decode step's rows in parts of about 2 values a thread (each part's CTA sums the
        # gate itself, in the same order: the same bits); a prompt chunk's one CTA a row
        parts = 1
        if self.shared_parts and n <= MAX_MATVEC_TOKENS:
            parts = max(1, -(-d // (2 * SHARED_THREADS)))
        kernel = self.kernels.kernel(SHARED_SOURCE, "moe_add_shared_f32")
        for t0 in range(0, n, MAX_GRID_Y):  # rows on the grid's y dimension
            off = t0 * d * 4  # bytes: every [N, d] operand is contiguous float32
            self.kernels.launch(
                kernel,
                (parts, min(MAX_GRID_Y, n - t0)),
                SHARED_THREADS,
                routed.data_ptr() + off,
                shared.data_ptr() + off,
                h.data_ptr() + off,
                0 if gate is None else gate.data_ptr(),
                0 if residual is None else residual.data_ptr() + off,
                out.data_ptr() + off,
                np.int32(d),
            )
        return out
