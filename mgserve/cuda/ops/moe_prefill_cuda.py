"""``MoePrefillCuda``: the MoE experts of a prompt chunk (N > 8 tokens) on kernels, two ways.

- ``grouped`` (the default): the (token, slot) pairs sorted by expert on the device, then two
  grouped tensor-core products straight from the GGUF blocks (qgemm.cu via ``QGemm``: gate/up
  fused with silu(gate) * up into f16 h, then down into fp32 y per pair) and the weighted
  combine in a fixed order (moe_prefill.cu). Tiles never mix experts and nothing is padded, so a
  token's result is bitwise independent of the other tokens and their routing; no host sync.
- the glue steps of the bucketed ``moe_prefill`` (moe_prefill.py, ``MoeCuda.cublas_prefill``):
  kernels/moe_prefill.cu for the row maps, the f16 gather of x, silu(gate) * up and the combine,
  and the linear family's dequant.cu launcher for the used experts' matrices (f16, into the
  linear family's per-stream scratch), with cuBLAS products (``f16_bmm_into``). Not
  batch-invariant: the buckets' padding and cuBLAS's algorithms depend on the other tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.grouped_rows import GroupedRows
from mgserve.cuda.ops.linear_cuda import LinearCuda
from mgserve.cuda.ops.moe import ExpertWeights

MOE_PREFILL_SOURCE = "moe_prefill.cu"
GATHER_THREADS = 128  # blockDim of moe_gather_f16 / moe_combine (4 values per thread)
ROW_THREADS = 256  # blockDim of moe_pair_rows / moe_silu_mul_f16


class MoePrefillCuda:
    """The prefill paths on kernels (see the module docstring)."""

    def __init__(self, kernels: Kernels, linear: LinearCuda) -> None:
        self.kernels, self.linear = kernels, linear
        self.device = kernels.device

    def scratch(self, n_elems: int, device: torch.device) -> torch.Tensor:
        return self.linear.scratch(n_elems)

    def dequant(
        self, w: ExpertWeights, ids: torch.Tensor, wgu: torch.Tensor, wdn: torch.Tensor
    ) -> None:
        ff, d, f16 = w.n_ff, w.n_embd, torch.float16
        if w.gate_up is not None:
            self.linear.dequant_rows(w.gate_up, wgu.data_ptr(), f16, 0, 2 * ff, ids, 2 * ff)
        else:
            assert w.gate is not None and w.up is not None
            self.linear.dequant_rows(w.gate, wgu.data_ptr(), f16, 0, ff, ids, ff, 2 * ff)
            up_ptr = wgu.data_ptr() + ff * d * wgu.element_size()
            self.linear.dequant_rows(w.up, up_ptr, f16, 0, ff, ids, ff, 2 * ff)
        self.linear.dequant_rows(w.down, wdn.data_ptr(), f16, 0, d, ids, d)

    def grouped(
        self, x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x), e = experts[:, j], on f16
        operands (x and h rounded once) with fp32 accumulation, by the grouped products.

        x [N, d] fp32, experts [N, kk] int32 (clamped to [0, E)), weights [N, kk] fp32 -> [N, d]
        fp32. Inputs are assumed checked (``MoeCuda.experts`` does)."""
        n, kk = experts.shape
        d, e, ff = w.n_embd, w.n_expert, w.n_ff
        p = n * kk
        flat = experts.reshape(-1).clamp(0, e - 1)  # [P] expert of each pair (token * kk + slot)
        sorted_e, order = torch.sort(flat, stable=True)  # [P] pairs grouped by expert
        gate, up_ptr, expert_rows = w.gate_up_storage()
        bm = self.linear.qgemm.grouped_bm(gate.type_name, w.down.type_name)
        groups = GroupedRows(sorted_e, e, bm)
        pair_row, row_token = self.rows(sorted_e, order, None, kk, p)  # [P], [P] int32
        x16 = self.linear.x16(x)  # [N, d]: x's f16 copy (its producer's or the router's: F16Rows)
        h = torch.empty(p, ff, dtype=torch.float16, device=self.device)  # [P, ff] sorted pairs
        self.linear.qgemm.gate_up(gate, up_ptr, expert_rows, x16, row_token, groups, h)
        y = torch.empty(p, d, dtype=torch.float32, device=self.device)  # [P, d] sorted pairs
        self.linear.qgemm.down(w.down, h, groups, y)
        return self.combine(y, pair_row.view(n, kk), weights)

    def rows(
        self, sorted_e: torch.Tensor, order: torch.Tensor, shift: torch.Tensor | None, kk: int,
        n_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """pair_row [P] (the row of every pair) and row_token [n_rows] (the token of every row),
        rows padded by ``shift`` (see moe_prefill.cu; None: row = sorted position)."""
        p = order.numel()
        pair_row = torch.empty(p, dtype=torch.int32, device=self.device)
        row_token = torch.zeros(n_rows, dtype=torch.int32, device=self.device)
        if p:
            self.kernels.launch(
                self.kernels.kernel(MOE_PREFILL_SOURCE, "moe_pair_rows"),
                -(-p // ROW_THREADS),
                ROW_THREADS,
                sorted_e.contiguous().data_ptr(),
                order.contiguous().data_ptr(),
                0 if shift is None else shift.data_ptr(),
                pair_row.data_ptr(),
                row_token.data_ptr(),
                np.int32(p),
                np.int32(kk),
            )
        return pair_row, row_token

    def gather(self, x: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
        r, d = row_token.numel(), x.shape[1]
        xs = torch.empty(r, d, dtype=torch.float16, device=self.device)  # [R, d]
        if r:
            vec = d % 4 == 0 and x.data_ptr() % 16 == 0
            self.kernels.launch(
                self.kernels.kernel(MOE_PREFILL_SOURCE, "moe_gather_f16"),
                r,
                GATHER_THREADS,
                x.data_ptr(),
                row_token.data_ptr(),
                xs.data_ptr(),
                np.int32(d),
                np.int32(vec),
            )
        return xs

    def silu_mul(self, gu: torch.Tensor, h: torch.Tensor) -> None:
        r, ff = h.shape
        if r:
            self.kernels.launch(
                self.kernels.kernel(MOE_PREFILL_SOURCE, "moe_silu_mul_f16"),
                r,
                ROW_THREADS,
                gu.data_ptr(),
                h.data_ptr(),
                np.int32(ff),
            )

    def combine(
        self, y: torch.Tensor, pair_row: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        n, kk = pair_row.shape
        d = y.shape[1]
        out = torch.empty(n, d, dtype=torch.float32, device=self.device)  # [N, d]
        if n:
            vec = d % 4 == 0 and y.data_ptr() % 16 == 0
            self.kernels.launch(
                self.kernels.kernel(MOE_PREFILL_SOURCE, "moe_combine"),
                (n, -(-d // (4 * GATHER_THREADS))),
                GATHER_THREADS,
                y.data_ptr(),
                pair_row.data_ptr(),
                weights.data_ptr(),
                out.data_ptr(),
                np.int32(kk),
                np.int32(d),
                np.int32(vec),
            )
        return out
