"""``LinearCuda``: the linear family on kernels, in two regimes chosen by the number of tokens N.

- decode (N <= 8): W is read once, in its GGUF block layout, by the matvec kernels (matvec.cu),
  or, with ``int8``, by the int8-activation kernels (linear_q8.py: x rounded to int8 per 32
  values first; several times faster, relative error ~1e-3 of |W| @ |x|), a bias and a
  residual added as each output is written;
- prefill (N > 8): tensor-core GEMMs that decode W's blocks into shared memory (qgemm.cu through
  ``QGemm``, ops/qgemm.py), or, from ``HGemmTuning.min_rows`` rows, decode W once into the f16
  scratch and multiply it (hgemm.cu through ``HGemm``, ops/hgemm.py): bitwise the same products
  (x rounded to f16, fp32 accumulation and output), so each token's row is independent of the
  batch on either path. With ``cublas_prefill``, the older path instead: W
  dequantized to f16 in row tiles (dequant.cu) into a per-stream scratch buffer and multiplied by
  cuBLAS (not batch-invariant: cuBLAS picks its algorithm by shape), kept to compare with and to
  fall back on; the MoE family's bucketed cuBLAS path shares its scratch.

Nothing here waits for the GPU: kernels go on the current stream (or the one given) and torch
allocates every buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.checks import check_vec4, check_weight, vec4_input
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.f16_products import f16_mm
from mgserve.cuda.ops.f16_rows import F16Rows
from mgserve.cuda.ops.hgemm import HGemm, HGemmTuning
from mgserve.cuda.ops.linear import LinearTorch, check_epilogue, check_linear, check_rows, epilogue
from mgserve.cuda.ops.linear_q8 import LinearQ8, epilogue_ptrs
from mgserve.cuda.ops.linear_tuning import (
    INT8_TYPES,
    MATVEC_SOURCE,
    MATVEC_WARPS_PER_CTA,
    MAX_MATVEC_TOKENS,
    Q8_ROWS,
    Q8_THREADS,
    MatvecTuning,
    Q8Activations,
    q8_rows,
    token_bucket,
)
from mgserve.cuda.ops.qgemm import QGemm
from mgserve.cuda.ops.rowpath import RowPath
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from cuda.core import Stream

DEQUANT_SOURCE = "dequant.cu"
DEQUANT_THREADS = 256  # DEQUANT_THREADS in dequant.cu: one thread per 8-value run
SCRATCH_BYTES = 256 << 20  # f16 dequantization scratch per stream (tiles are sized to fit)


class LinearCuda:
    """Linear layers on the matvec / int8 / qgemm kernels (module docstring).

    ``int8``: decode products of INT8_TYPES weights use int8 activations. ``prefill_exact``:
    prompt chunks multiply the dequantized fp32 weights of the torch version instead of f16 tiles
    (comparing whole models with the reference without the f16 rounding; slow).
    ``cublas_prefill``: prompt chunks take the dequant + cuBLAS path. ``q8_*``: the int8 kernels'
    shape, tensor cores for 2..8 tokens (``LinearQ8``); ``hgemm``: long prompts' f16 GEMM tiles."""

    def __init__(
        self,
        kernels: Kernels,
        fallback: LinearTorch,
        tuning: MatvecTuning | None = None,
        q8_rows: tuple[int, int] = Q8_ROWS,
        q8_group: int = Q8_THREADS,
        hgemm: HGemmTuning | None = None,
        q8_mma: bool = False,
    ) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device
        self.tuning = tuning or MatvecTuning()
        self.q8 = LinearQ8(kernels, q8_rows, q8_group, q8_mma)
        self.int8 = False
        self.prefill_exact = False
        self.cublas_prefill = False
        self.fused_decode = True  # producers write int8 activations (``fused_xq``)
        self.path = RowPath()  # decode kernels or GEMMs: set by the runner per step (rowpath.py)
        self.qgemm = QGemm(kernels)
        self.hgemm = HGemm(kernels, hgemm)  # prompts of >= hgemm.tuning.min_rows rows
        self._scratch: dict[int, torch.Tensor] = {}  # f16, per torch stream handle
        self.x16 = F16Rows(self.path)  # prompt activations in f16, made once (f16_rows.py)

    # -- decode kernels ------------------------------------------------------------------------

    def matvec(
        self,
        w: QuantWeight,
        x: torch.Tensor,
        stream: Stream | None = None,
        out: torch.Tensor | None = None,
        int8: bool = False,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        xq: Q8Activations | None = None,
    ) -> torch.Tensor:
        """y = residual + (x @ W^T + bias) for a quantized W [rows, k] and fp32 x [k] or
        [n_tok, k], n_tok <= 8; bias [rows] and residual (y's shape) are optional, contiguous.

        With ``int8`` (types in INT8_TYPES only) x is first rounded to int8 groups
        (``LinearQ8.quantize``, or ``xq`` when the caller has it) and multiplied with integer dot
        products: exact for the rounded x rather than x itself.

        Returns fp32 y [rows] or [n_tok, rows] (written into ``out`` when given). The kernel is
        queued on ``stream`` (default: torch's current one); buffers must be ready on it.
        Torch allocates ``out`` on torch's current stream, so give another ``stream`` only under
        ``torch.cuda.stream(runtime.torch_stream(stream))``: the caching allocator then reuses
        the memory only after that stream's work, not another's.
        """
        check_weight(w, self.device)
        rows, k = w.rows, w.k
        if x.dim() not in (1, 2) or x.shape[-1] != k:
            raise ValueError(f"{w.name}: x has shape {list(x.shape)}, expected [{k}] or [n, {k}]")
        n_tok = 1 if x.dim() == 1 else x.shape[0]
        if not 1 <= n_tok <= MAX_MATVEC_TOKENS:
            raise ValueError(f"{w.name}: matvec takes 1..{MAX_MATVEC_TOKENS} tokens, got {n_tok}")
        check_vec4("x", x, self.device, torch.float32)
        out_shape = (rows,) if x.dim() == 1 else (n_tok, rows)
        if out is None:
            out = torch.empty(out_shape, dtype=torch.float32, device=self.device)
        elif tuple(out.shape) != out_shape:
            raise ValueError(
                f"{w.name}: out has shape {list(out.shape)}, expected {list(out_shape)}"
            )
        check_vec4("out", out, self.device, torch.float32)
        tail = epilogue_ptrs(w, out, bias, residual, self.device)
        if int8:
            if w.type_name not in INT8_TYPES:
                raise ValueError(
                    f"{w.name}: no int8 matvec for type {w.type_name} "
                    f"(int8 types: {', '.join(sorted(INT8_TYPES))}); use int8=False"
                )
            if xq is None:
                xq = self.q8.quantize(x.reshape(n_tok, k), stream)
            self.q8.matvec(w, xq, stream, out.view(n_tok, rows), bias, residual)
            return out

        bucket = token_bucket(n_tok)
        kernel = self.kernels.kernel(
            MATVEC_SOURCE, f"matvec_{w.type_name}_t{bucket}", self.tuning.defines()
        )
        per_cta = self.tuning.rows_per_cta(bucket)
        self.kernels.launch(
            kernel,
            (rows + per_cta - 1) // per_cta,
            32 * MATVEC_WARPS_PER_CTA,
            w.data.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            np.int32(rows),
            np.int32(k),
            np.int32(n_tok),
            *tail,
            stream=stream,
        )
        return out

    def quantize(self, x: torch.Tensor) -> Q8Activations | None:
        """x [N, k] rounded to int8 once for every int8 ``matmul`` (and ``moe.experts``) of it
        (its producer's, ``LinearQ8.offer``); None where no product reads it (N > 8, k % 32)."""
        if not (self.int8 and q8_rows(*x.shape)):
            return None
        return self.q8.offered(x) or self.q8.quantize(vec4_input("x", x, self.device))

    def fused_xq(self, n: int, k: int) -> bool:
        """Whether the producer of decode rows [n, k] writes their ``quantize`` too (fused)."""
        return self.fused_decode and self.int8 and self.path.decode_kernels(n) and q8_rows(n, k)

    # -- prefill with cuBLAS: dequantized tiles ------------------------------------------------

    def scratch(self, n_elems: int) -> torch.Tensor:
        """An f16 buffer of at least ``n_elems`` values for the current stream, reused by later
        calls on that stream (stream order makes reuse safe). Call it before a CUDA graph
        capture with the largest size the graph needs, so capture never allocates it."""
        key = torch.cuda.current_stream(self.device).cuda_stream
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n_elems:
            buf = self._scratch[key] = torch.empty(n_elems, dtype=torch.float16, device=self.device)
        return buf

    def dequant_rows(
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
        """Launch dequant.cu on checked arguments: out row (g, r) = W row (ids[g] * group_stride
        + row0 + r), g over ids (one group, ids[0] = 0, without them), written at
        out_ptr + (g * out_group_rows + r) rows."""
        n_groups = 1 if ids is None else ids.numel()
        if n_rows == 0 or n_groups == 0:
            return
        suffix = "f16" if dtype == torch.float16 else "f32"
        kernel = self.kernels.kernel(DEQUANT_SOURCE, f"dequant_{w.type_name}_{suffix}")
        runs = n_rows * (w.k // 8)
        grid = ((runs + DEQUANT_THREADS - 1) // DEQUANT_THREADS, n_groups)
        self.kernels.launch(
            kernel, grid, DEQUANT_THREADS, w.data.data_ptr(), out_ptr,
            0 if ids is None else ids.data_ptr(), np.int64(group_stride), np.int64(row0),
            np.int32(n_rows), np.int32(out_group_rows or n_rows), np.int32(w.k),
        )  # fmt: skip

    # -- ops -------------------------------------------------------------------------------------

    def dequantize(self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [row0, row0 + n_rows) of W into ``out`` [n_rows, k] f16 (or fp32), on the
        current stream. f16 rounds each value to nearest (|W| > 65504 would overflow)."""
        check_weight(w, self.device)
        check_rows(w, row0, n_rows, out)
        check_vec4("out", out, self.device, out.dtype)
        self.dequant_rows(w, out.data_ptr(), out.dtype, row0, n_rows)
        return out

    def matmul(
        self,
        x: torch.Tensor,
        w: QuantWeight,
        *,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        xq: Q8Activations | None = None,
    ) -> torch.Tensor:
        """x [N, k] fp32 -> residual + (x @ W^T + bias) [N, w.rows] fp32 (LinearTorch.matmul).

        Decode rows (``self.path``: a decode step, or N <= 8 outside a runner step): the matvec
        kernels, 8 tokens at a time (int8 activations when ``self.int8`` and the type has them;
        ``xq`` from ``quantize(x)`` saves rounding x again), bias and residual added as each
        output is written. Prompt rows: ``QGemm.matmul``, or from ``self.hgemm.tuning.min_rows``
        rows W decoded to f16 in row tiles of at most SCRATCH_BYTES and ``HGemm.matmul`` (the
        same bits), or with ``cublas_prefill`` such tiles multiplied by cuBLAS; all round x and W
        to f16 and accumulate in fp32: relative error ~1e-3 of |x| @ |W|^T at worst; bias and
        residual added after.
        """
        check_weight(w, self.device)
        check_linear(x, w)
        check_epilogue(x, w, bias, residual)
        x = vec4_input("x", x, self.device)
        n, rows = x.shape[0], w.rows
        if n == 0 or self.path.decode_kernels(n):
            out = torch.empty(n, rows, dtype=torch.float32, device=self.device)  # [N, rows]
            int8 = self.int8 and w.type_name in INT8_TYPES
            if residual is not None:
                residual = residual.contiguous()
            step = MAX_MATVEC_TOKENS  # a decode step of more sessions: groups of 8 tokens
            for r0 in range(0, n, step):
                g = slice(r0, r0 + step)
                self.matvec(
                    w, x[g], self.kernels.stream(), out=out[g], int8=int8, bias=bias,
                    residual=None if residual is None else residual[g],
                    xq=xq if int8 and n <= step else None,
                )  # fmt: skip
            return out
        return epilogue(self._prefill(x, w), bias, residual)

    def end_prompt(self) -> None:  # a prompt step is over: F16Rows' f16 copies go
        self.x16.clear()

    def _prefill(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        n, k, rows = x.shape[0], w.k, w.rows
        if self.prefill_exact:  # fp32 weights and product (tests, debugging: slow, memory-hungry)
            return self.fallback.matmul(x, w)
        invariant = not self.cublas_prefill  # qgemm.cu, or its W decoded once and hgemm.cu
        x16 = self.x16(x)  # [N, k]
        if invariant and n < self.hgemm.tuning.min_rows:
            return self.qgemm.matmul(x16, w)
        tile = max(1, min(rows, SCRATCH_BYTES // (2 * k)))  # rows per f16 tile
        buf = self.scratch(tile * k)
        if tile == rows and not invariant:  # cuBLAS' usual case: one tile, written directly
            self.dequant_rows(w, buf.data_ptr(), torch.float16, 0, rows)
            return f16_mm(x16, buf[: rows * k].view(rows, k))
        out = torch.empty(n, rows, dtype=torch.float32, device=self.device)  # [N, rows]
        for r0 in range(0, rows, tile):
            m = min(tile, rows - r0)
            wt = buf[: m * k].view(m, k)  # [m, k] f16
            if invariant:
                self.qgemm.dequantize(w, r0, m, wt)
                self.hgemm.matmul(x16, wt, out[:, r0 : r0 + m])
            else:
                self.dequant_rows(w, wt.data_ptr(), torch.float16, r0, m)
                out[:, r0 : r0 + m] = f16_mm(x16, wt)
        return out
