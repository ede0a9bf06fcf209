"""Quantized linear layers and mixture-of-experts FFNs (DESIGN.md: kernels read blocks).

Two regimes, chosen by the number of tokens N:

- decode (N <= 8): the weights are read once, in their GGUF block layout, by matvec-style kernels
  (``CudaOps.matvec`` for a linear layer; kernels/moe.cu for the experts, which read only the
  selected experts' rows, with expert ids read on the device so a step captures into a CUDA graph).
- prefill (N > 8): W is dequantized to f16 in row tiles (kernels/dequant.cu) into a scratch buffer
  and multiplied by cuBLAS with fp32 accumulation and fp32 output; MoE groups the (token, slot)
  pairs by expert first (one host sync for the per-expert counts) and runs moe_prefill.py's
  bucketed batched products (a fixed handful of launches per layer, two cuBLAS calls a bucket).

``MatmulTorch`` is the plain PyTorch twin (CPU in CI, and the oracle of the GPU tests).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mgserve.core.reference import ops as ref_ops
from mgserve.core.reference import rowwise
from mgserve.cuda.kbase import CudaBase, check_cuda, check_weight
from mgserve.cuda.moe_prefill import MoePrefillCuda, MoePrefillTorch
from mgserve.cuda.ops import INT8_TYPES, MAX_MATVEC_TOKENS, CudaOps
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.compiler import KernelCompiler

DEQUANT_SOURCE = "dequant.cu"
DEQUANT_THREADS = 256  # DEQUANT_THREADS in dequant.cu: one thread per 8-value run
MOE_SOURCE = "moe.cu"
MOE_Q8_SOURCE = "moe_q8.cu"
MOE_WARPS = 4  # MOE_WARPS in moe.cu / moe_q8.cu
MOE_MAX_KK = 64  # MOE_MAX_KK there: experts per token
MOE_Q8_TYPES = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0"})  # expert formats of moe_q8.cu
MAX_DECODE_TOKENS = MAX_MATVEC_TOKENS  # above this, prefill: dequantized tiles and cuBLAS
SCRATCH_BYTES = 256 << 20  # f16 dequantization scratch per stream (tiles are sized to fit)


class ExpertWeights(NamedTuple):
    """One layer's routed experts as GGUF stores them (3-D tensors, expert index outermost).

    Either ``gate`` and ``up`` (ffn_gate_exps / ffn_up_exps, GGUF shape (d, ff, E): rows E * ff,
    expert e = rows [e ff, (e + 1) ff)) or ``gate_up`` (ffn_gate_up_exps, (d, 2 ff, E): expert e =
    gate rows [2e ff, 2e ff + ff), then its ff up rows). ``down`` is ffn_down_exps, (ff, d, E):
    rows E * d, expert e = rows [e d, (e + 1) d).
    """

    gate: QuantWeight | None
    up: QuantWeight | None
    gate_up: QuantWeight | None
    down: QuantWeight
    n_expert: int
    n_ff: int

    @property
    def n_embd(self) -> int:
        return self.down.rows // max(self.n_expert, 1)

    @property
    def gate_type(self) -> str:
        """The format of the gate and up matrices (they must share one)."""
        w = self.gate_up if self.gate_up is not None else self.gate
        assert w is not None
        return w.type_name


# ---- validation (shared by both backends) -------------------------------------------------------


def _check_linear(x: torch.Tensor, w: QuantWeight) -> None:
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"{w.name}: x has shape {list(x.shape)}, expected [N, {w.k}]")
    if x.dtype != torch.float32:
        raise ValueError(f"{w.name}: x must be float32, got {x.dtype}")


def _check_rows(w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> None:
    if row0 < 0 or n_rows < 0 or row0 + n_rows > w.rows:
        raise ValueError(f"{w.name}: rows [{row0}, {row0 + n_rows}) outside [0, {w.rows})")
    if tuple(out.shape) != (n_rows, w.k):
        raise ValueError(f"{w.name}: out has shape {list(out.shape)}, expected [{n_rows}, {w.k}]")
    if out.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"{w.name}: out must be float16 or float32, got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"{w.name}: out must be contiguous")


def _check_experts(w: ExpertWeights) -> None:
    """ValueError unless ``w``'s tensors have the shapes of E experts of width ff."""
    e, ff = w.n_expert, w.n_ff
    if e <= 0 or ff <= 0:
        raise ValueError(f"ExpertWeights: n_expert {e} and n_ff {ff} must be positive")
    d = w.down.rows // e
    if w.down.rows != e * d or w.down.k != ff:
        raise ValueError(
            f"{w.down.name}: {w.down.rows} x {w.down.k} is not {e} experts of [d, {ff}]"
        )
    if w.gate_up is not None:
        if w.gate is not None or w.up is not None:
            raise ValueError("ExpertWeights: give gate_up or gate and up, not both")
        if w.gate_up.rows != e * 2 * ff or w.gate_up.k != d:
            raise ValueError(
                f"{w.gate_up.name}: {w.gate_up.rows} x {w.gate_up.k} is not {e} experts of "
                f"[2 * {ff}, {d}]"
            )
        return
    if w.gate is None or w.up is None:
        raise ValueError("ExpertWeights: gate and up (or gate_up) are required")
    for m in (w.gate, w.up):
        if m.rows != e * ff or m.k != d:
            raise ValueError(f"{m.name}: {m.rows} x {m.k} is not {e} experts of [{ff}, {d}]")
    if w.gate.type_name != w.up.type_name:
        raise ValueError(
            f"{w.gate.name} is {w.gate.type_name} but {w.up.name} is {w.up.type_name}: "
            "gate and up must share a format"
        )


def _check_moe(
    x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
) -> None:
    _check_experts(w)
    d = w.n_embd
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"moe_experts: x has shape {list(x.shape)}, expected [N, {d}]")
    if x.dtype != torch.float32:
        raise ValueError(f"moe_experts: x must be float32, got {x.dtype}")
    n = x.shape[0]
    if experts.dim() != 2 or experts.shape[0] != n or not 1 <= experts.shape[1] <= MOE_MAX_KK:
        raise ValueError(
            f"moe_experts: experts has shape {list(experts.shape)}, expected [{n}, 1..{MOE_MAX_KK}]"
        )
    if experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_experts: experts must be int32 (or int64), got {experts.dtype}")
    if tuple(weights.shape) != tuple(experts.shape) or weights.dtype != torch.float32:
        raise ValueError(
            f"moe_experts: weights must be float32 {list(experts.shape)}, got "
            f"{weights.dtype} {list(weights.shape)}"
        )


def _combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * y[:, j] for y [N, kk, d], in the fixed order j = 0, 1, ... with
    elementwise ops only, so each token's sum is the same whatever else is in the batch."""
    out = y[:, 0] * weights[:, 0:1]  # [N, d]
    for j in range(1, y.shape[1]):
        out.addcmul_(y[:, j], weights[:, j : j + 1])
    return out


# ---- torch ---------------------------------------------------------------------------------------


def _rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, k] @ w [m, k]^T. On the CPU through the reference path's ``ops.linear``, whose row
    blocks make each row's result independent of N (BLAS picks its kernel, and so its rounding,
    by the row count); elsewhere one product."""
    if x.device.type == "cpu":
        return ref_ops.linear(x, w)
    return x @ w.T


class MatmulTorch(MoePrefillTorch):
    """Linear layers and MoE experts on dequantized (cached) weights, in plain PyTorch.

    Each token's result is independent of the rest of the batch on the CPU (``_rows_linear``,
    ``rowwise.silu``), as on the reference path."""

    def linear(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        """x [N, k] fp32 -> x @ W^T [N, w.rows] fp32."""
        _check_linear(x, w)
        return _rows_linear(x, self.dense(w))

    def dequantize(self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0 + n_rows) of W into ``out`` [n_rows, k] (f16 or fp32)."""
        _check_rows(w, row0, n_rows, out)
        out.copy_(self.dense(w)[row0 : row0 + n_rows])
        return out

    def moe_experts(
        self, x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x), e = experts[:, j].

        x [N, d] fp32, experts [N, kk] int32/int64 (clamped to [0, E)), weights [N, kk] fp32 ->
        [N, d] fp32. Every expert runs on every token (static shapes, no host sync, so it
        captures into a CUDA graph) and each token then gathers its kk results: N * E * d work,
        meant for tiny test models only.
        """
        _check_moe(x, w, experts, weights)
        n, d, e, ff = x.shape[0], w.n_embd, w.n_expert, w.n_ff
        if w.gate_up is not None:
            gu = _rows_linear(x, self.dense(w.gate_up)).view(n, e, 2, ff)  # [N, E, 2, ff]
            g, u = gu[:, :, 0], gu[:, :, 1]  # [N, E, ff]
        else:
            assert w.gate is not None and w.up is not None
            g = _rows_linear(x, self.dense(w.gate)).view(n, e, ff)  # [N, E, ff]
            u = _rows_linear(x, self.dense(w.up)).view(n, e, ff)
        h = rowwise.silu(g) * u  # [N, E, ff]
        down = self.dense(w.down).view(e, d, ff)  # [E, d, ff]
        y = torch.stack([_rows_linear(h[:, i], down[i]) for i in range(e)], dim=1)  # [N, E, d]
        idx = experts.long().clamp(0, e - 1)  # [N, kk]
        sel = torch.gather(y, 1, idx[:, :, None].expand(-1, -1, d))  # [N, kk, d]
        return _combine(sel, weights)


# ---- CUDA ----------------------------------------------------------------------------------------


@functools.cache
def _out_dtype_works(device: torch.device) -> bool:
    """Whether this torch's mm / bmm take out_dtype=float32 for f16 operands on ``device``
    (torch >= 2.8 on CUDA), tried once on a 1x1 product."""
    one = torch.ones(1, 1, dtype=torch.float16, device=device)
    try:
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def _f16_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, k] f16 @ b [..., n, k]^T f16 -> fp32 [..., M, n] (2-D: mm, 3-D: bmm): cuBLAS
    with fp32 accumulation and fp32 output (no f16 rounding or overflow of the result). A torch
    without ``out_dtype`` gets an fp32 product of the upcast operands (same inputs, slower)."""
    op = torch.mm if a.dim() == 2 else torch.bmm
    bt = b.transpose(-1, -2)
    if _out_dtype_works(a.device):
        return op(a, bt, out_dtype=torch.float32)
    return op(a.float(), bt.float())


class MatmulCuda(CudaBase, MoePrefillCuda, MatmulTorch):
    """The same ops on NVRTC kernels (decode) and dequantized tiles + cuBLAS (prefill).

    ``int8``: decode products of INT8_TYPES / MOE_Q8_TYPES weights round the activations to int8
    per 32 values (matvec_q8.cu): several times faster, relative error ~1e-3. ``moe_rows``: rows
    per warp of the MoE gate/up and down kernels (GU_ROWS / DOWN_ROWS of moe.cu), for tuning.
    """

    def __init__(
        self,
        compiler: KernelCompiler,
        int8: bool = False,
        ops: CudaOps | None = None,
        moe_rows: tuple[int, int] = (1, 1),
    ) -> None:
        super().__init__(compiler)
        if len(moe_rows) != 2 or not all(1 <= r <= 8 for r in moe_rows):
            raise ValueError(f"moe_rows must be two row counts in 1..8, got {moe_rows}")
        self.matvec_ops = ops or CudaOps(compiler)
        self.int8 = int8
        # True: prompt chunks (N > 8) multiply dequantized fp32 weights in fp32 instead of f16
        # tiles; for comparing whole models with the reference without the f16 rounding
        self.prefill_exact = False
        self.moe_rows = moe_rows
        self._moe_kernel_defines = (("GU_ROWS", str(moe_rows[0])), ("DOWN_ROWS", str(moe_rows[1])))
        self._mm_scratch: dict[int, torch.Tensor] = {}  # f16, per torch stream handle

    # -- helpers --

    def _mm_check_weight(self, w: QuantWeight) -> None:
        check_weight(w, self.device)

    def _mm_check_act(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
        check_cuda(name, t, self.device, dtype)
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (the kernels read float4)")

    def _mm_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the kernels read it: contiguous and 16-byte aligned (a copy only when it is not:
        model code passes views), on this GPU and float32 (else ValueError)."""
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
        self._mm_check_act("x", x, torch.float32)
        return x

    def matmul_scratch(self, n_elems: int) -> torch.Tensor:
        """An f16 buffer of at least ``n_elems`` values for the current stream, reused by later
        calls on that stream (stream order makes reuse safe). Call it before a CUDA graph
        capture with the largest size the graph needs, so capture never allocates it."""
        key = torch.cuda.current_stream(self.device).cuda_stream
        buf = self._mm_scratch.get(key)
        if buf is None or buf.numel() < n_elems:
            buf = self._mm_scratch[key] = torch.empty(
                n_elems, dtype=torch.float16, device=self.device
            )
        return buf

    def _mm_dequant(
        self,
        w: QuantWeight,
        out_ptr: int,
        dtype: torch.dtype,
        row0: int,
        n_rows: int,
        ids: torch.Tensor | None = None,
        group_stride: int = 0,
        out_group_rows: int = 0,
    ) -> None:
        """Launch dequant.cu: out row (g, r) = W row (ids[g] * group_stride + row0 + r), g over
        ids (one group, ids[0] = 0, without them), written at out_ptr + (g * out_group_rows + r)
        rows."""
        n_groups = 1 if ids is None else ids.numel()
        if n_rows == 0 or n_groups == 0:
            return
        suffix = "f16" if dtype == torch.float16 else "f32"
        kernel = self.kernel(DEQUANT_SOURCE, f"dequant_{w.type_name}_{suffix}")
        runs = n_rows * (w.k // 8)
        grid = ((runs + DEQUANT_THREADS - 1) // DEQUANT_THREADS, n_groups)
        self.launch(
            kernel,
            grid,
            DEQUANT_THREADS,
            w.data.data_ptr(),
            out_ptr,
            0 if ids is None else ids.data_ptr(),
            np.int64(group_stride),
            np.int64(row0),
            np.int32(n_rows),
            np.int32(out_group_rows or n_rows),
            np.int32(w.k),
        )

    # -- linear --

    def dequantize(self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0 + n_rows) of W into ``out`` [n_rows, k] f16 (or fp32), on the
        current stream. f16 rounds each value to nearest (|W| > 65504 would overflow)."""
        self._mm_check_weight(w)
        _check_rows(w, row0, n_rows, out)
        self._mm_check_act("out", out, out.dtype)
        self._mm_dequant(w, out.data_ptr(), out.dtype, row0, n_rows)
        return out

    def linear(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        """x [N, k] fp32 -> x @ W^T [N, w.rows] fp32.

        N <= 8: the matvec kernels (int8 activations when ``self.int8`` and the type has them).
        N > 8: W dequantized to f16 in row tiles of at most SCRATCH_BYTES and multiplied by cuBLAS
        (x rounded to f16, fp32 accumulation and output): relative error ~1e-3 of |x| @ |W|^T.
        """
        self._mm_check_weight(w)
        _check_linear(x, w)
        x = self._mm_input(x)
        n, k, rows = x.shape[0], w.k, w.rows
        if n <= MAX_DECODE_TOKENS:
            out = torch.empty(n, rows, dtype=torch.float32, device=self.device)  # [N, rows]
            if n == 0:
                return out
            int8 = self.int8 and w.type_name in INT8_TYPES
            self.matvec_ops.matvec(w, x, self.stream(), out=out, int8=int8)
            return out
        if self.prefill_exact:  # fp32 weights and product (tests, debugging: slow, memory-hungry)
            return MatmulTorch.linear(self, x, w)
        x16 = x.to(torch.float16)  # [N, k]
        tile = max(1, min(rows, SCRATCH_BYTES // (2 * k)))  # rows per f16 tile
        buf = self.matmul_scratch(tile * k)
        if tile == rows:  # the usual case: one tile, cuBLAS writes the result directly
            self._mm_dequant(w, buf.data_ptr(), torch.float16, 0, rows)
            return _f16_product(x16, buf[: rows * k].view(rows, k))
        out = torch.empty(n, rows, dtype=torch.float32, device=self.device)  # [N, rows]
        for r0 in range(0, rows, tile):
            m = min(tile, rows - r0)
            wt = buf[: m * k].view(m, k)  # [m, k] f16
            self._mm_dequant(w, wt.data_ptr(), torch.float16, r0, m)
            out[:, r0 : r0 + m] = _f16_product(x16, wt)
        return out

    # -- MoE --

    def _moe_gate_up_ptrs(self, w: ExpertWeights) -> tuple[int, int, int]:
        """Pointers to expert 0's gate and up row 0, and rows per expert of that storage."""
        ff = w.n_ff
        if w.gate_up is not None:
            base = w.gate_up.data.data_ptr()
            return base, base + ff * w.gate_up.data.shape[1], 2 * ff
        assert w.gate is not None and w.up is not None
        return w.gate.data.data_ptr(), w.up.data.data_ptr(), ff

    def moe_experts(
        self, x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x), e = experts[:, j].

        x [N, d] fp32, experts [N, kk] int32 (int64 is converted on the device; ids outside
        [0, E) are clamped), weights [N, kk] fp32 -> [N, d] fp32.
        N <= 8: two kernels (moe.cu, or moe_q8.cu with ``int8``), no host sync: graph-capturable,
        and each token's result is bitwise independent of the rest of the batch.
        N > 8: ``moe_prefill`` (moe_prefill.py): pairs sorted by expert (one host sync for the
        counts), all used experts dequantized to f16 in one launch per matrix, batched cuBLAS
        products (fp32 accumulation) over buckets of experts with similar counts; per-pair
        results summed over j in a fixed order.
        """
        _check_moe(x, w, experts, weights)
        for m in (w.gate, w.up, w.gate_up, w.down):
            if m is not None:
                self._mm_check_weight(m)
        if -(-max(w.n_ff, w.n_embd) // MOE_WARPS) > 65535:
            raise ValueError(f"moe_experts: {max(w.n_ff, w.n_embd)} rows exceed the kernels' grid")
        x = self._mm_input(x)
        if experts.dtype != torch.int32:
            experts = experts.to(torch.int32)
        experts, weights = experts.contiguous(), weights.contiguous()
        check_cuda("experts", experts, self.device, torch.int32)
        check_cuda("weights", weights, self.device, torch.float32)
        n = x.shape[0]
        if n > MAX_DECODE_TOKENS and self.prefill_exact:
            return MatmulTorch.moe_experts(self, x, w, experts, weights)
        if n == 0:
            return torch.zeros_like(x)
        if n <= MAX_DECODE_TOKENS:
            return self._moe_decode(x, w, experts, weights)
        return self._moe_prefill(x, w, experts, weights)

    def _moe_decode(
        self, x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        gate, up, expert_rows = self._moe_gate_up_ptrs(w)
        n, kk = experts.shape
        d, e, ff = w.n_embd, w.n_expert, w.n_ff
        stream = self.stream()
        h = torch.empty(n, kk, ff, dtype=torch.float32, device=self.device)  # [N, kk, ff]
        out = torch.empty(n, d, dtype=torch.float32, device=self.device)  # [N, d]
        gt, dt = w.gate_type, w.down.type_name
        # pairs / tokens on the fast grid axis, row tiles on y (see moe.cu)
        grid = (n * kk, -(-ff // (MOE_WARPS * self.moe_rows[0])))
        tail = (experts.data_ptr(), h.data_ptr(), np.int32(kk), np.int32(ff), np.int32(d))
        if self.int8 and gt in MOE_Q8_TYPES:
            xq = self.matvec_ops.quantize_q8(x, stream)
            kernel = self.kernel(MOE_Q8_SOURCE, f"moe_q8_gate_up_{gt}", self._moe_kernel_defines)
            act: tuple[int, ...] = (xq.q.data_ptr(), xq.d.data_ptr())
        else:
            kernel = self.kernel(MOE_SOURCE, f"moe_gate_up_{gt}", self._moe_kernel_defines)
            act = (x.data_ptr(),)
        self.launch(
            kernel, grid, 32 * MOE_WARPS, gate, up, np.int64(expert_rows), *act, *tail, np.int32(e)
        )
        grid = (n, -(-d // (MOE_WARPS * self.moe_rows[1])))
        if self.int8 and dt in MOE_Q8_TYPES:
            hq = self.matvec_ops.quantize_q8(h.view(n * kk, ff), stream)
            kernel = self.kernel(MOE_Q8_SOURCE, f"moe_q8_down_{dt}", self._moe_kernel_defines)
            act = (hq.q.data_ptr(), hq.d.data_ptr())
        else:
            kernel = self.kernel(MOE_SOURCE, f"moe_down_{dt}", self._moe_kernel_defines)
            act = (h.data_ptr(),)
        self.launch(
            kernel,
            grid,
            32 * MOE_WARPS,
            w.down.data.data_ptr(),
            np.int64(d),
            *act,
            experts.data_ptr(),
            weights.data_ptr(),
            out.data_ptr(),
            np.int32(kk),
            np.int32(d),
            np.int32(ff),
            np.int32(e),
        )
        return out

    def _moe_prefill(
        self, x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The bucketed prefill path of moe_prefill.py (kernels + batched cuBLAS products)."""
        return self.moe_prefill(x, w, experts, weights)
