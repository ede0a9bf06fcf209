"""Checked launch wrappers, one per kernel family: validate shapes, dtypes, devices, contiguity and
block alignment with a clear ValueError, then launch on the caller's stream. Nothing here waits for
the GPU: the caller owns ordering (streams, events) and torch allocates every buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.compiler import KernelCompiler
from mgserve.cuda.weights import FORMATS, QuantWeight

if TYPE_CHECKING:
    from cuda.core import Kernel, Stream

MATVEC_SOURCE = "matvec.cu"
MATVEC_WARPS_PER_CTA = 4  # WARPS_PER_CTA in matvec.cu
MATVEC_TOKEN_BUCKETS = (1, 2, 4, 8)  # the kernel's NT instances; a call uses the smallest fit
MAX_MATVEC_TOKENS = MATVEC_TOKEN_BUCKETS[-1]
Q8_SOURCE = "matvec_q8.cu"
Q8_THREADS = 128  # Q8_THREADS in matvec_q8.cu: threads per CTA of the int8 kernels
Q8_GROUP = 32  # activation values per int8 scale
INT8_TYPES = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0"})  # formats with an int8-activation kernel


@dataclass(frozen=True)
class Q8Activations:
    """Activations rounded to int8 for the int8 matvec: x ~= d * q per group of 32 values.

    Made once per input vector by ``CudaOps.quantize_q8`` and reusable by every matvec that reads
    the same x (q/k/v, gate/up), which is where the quantization pays for itself."""

    q: torch.Tensor  # int8 [n_tok, k]
    d: torch.Tensor  # fp32 [n_tok, k / 32]

    @property
    def n_tok(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]


@dataclass(frozen=True)
class MatvecTuning:
    """Compile-time shape of the matvec kernels (-D macros of matvec.cu), measured on the H200 by
    ``mgserve bench matvec --tunings``."""

    rows_per_warp_1: int = 1  # output rows per warp for one token
    rows_per_warp_n: int = 2  # for 2..8 tokens: each activation load serves this many rows
    unroll: int = 4  # run-loop unroll: independent weight loads in flight per lane

    def __post_init__(self) -> None:
        for name in ("rows_per_warp_1", "rows_per_warp_n", "unroll"):
            if not 1 <= getattr(self, name) <= 8:
                raise ValueError(f"MatvecTuning.{name} must be in 1..8, got {getattr(self, name)}")

    @classmethod
    def parse(cls, text: str) -> MatvecTuning:
        """ "R1,RN,U" (e.g. "1,2,4") as written on the bench's command line."""
        try:
            r1, rn, u = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError(
                f"matvec tuning {text!r}: expected three integers R1,RN,UNROLL"
            ) from None
        return cls(r1, rn, u)

    def defines(self) -> tuple[tuple[str, str], ...]:
        return (
            ("ROWS_PER_WARP_1", str(self.rows_per_warp_1)),
            ("ROWS_PER_WARP_N", str(self.rows_per_warp_n)),
            ("RUN_UNROLL", str(self.unroll)),
        )

    def rows_per_cta(self, bucket: int) -> int:
        per_warp = self.rows_per_warp_1 if bucket == 1 else self.rows_per_warp_n
        return MATVEC_WARPS_PER_CTA * per_warp


def _check_fp32_cuda(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (the kernel reads float4)")


class CudaOps:
    """The kernel families of one GPU, loaded once through ``compiler`` (cubin cache)."""

    def __init__(
        self,
        compiler: KernelCompiler,
        tuning: MatvecTuning | None = None,
        q8_rows: tuple[int, int] = (2, 2),
        q8_group: int = 128,
    ) -> None:
        """``q8_rows``: output rows per thread group of the int8 kernels for one token and for
        2..8; ``q8_group``: threads sharing those rows, 32 (a warp) or 128 (the CTA). They are
        the Q8_ROWS_1 / Q8_ROWS_N / Q8_GROUP_THREADS macros of matvec_q8.cu, measured by
        ``bench matvec --q8-rows``."""
        if len(q8_rows) != 2 or not all(1 <= r <= 8 for r in q8_rows):
            raise ValueError(f"q8_rows must be two row counts in 1..8, got {q8_rows}")
        if q8_group not in (32, Q8_THREADS):
            raise ValueError(f"q8_group must be 32 or {Q8_THREADS}, got {q8_group}")
        self.compiler = compiler
        self.tuning = tuning or MatvecTuning()
        self.q8_rows = q8_rows
        self.q8_group = q8_group
        self._matvec_opts = compiler.options(defines=self.tuning.defines())
        q8_defines = (
            ("Q8_ROWS_1", str(q8_rows[0])),
            ("Q8_ROWS_N", str(q8_rows[1])),
            ("Q8_GROUP_THREADS", str(q8_group)),
        )
        self._q8_opts = compiler.options(defines=q8_defines)
        self.device = torch.device("cuda", compiler.device_index)
        self._kernels: dict[str, Kernel] = {}

    def _kernel(self, source: str, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            opts = {MATVEC_SOURCE: self._matvec_opts, Q8_SOURCE: self._q8_opts}.get(source)
            k = self._kernels[name] = self.compiler.kernel(source, name, opts)
        return k

    def matvec(
        self,
        w: QuantWeight,
        x: torch.Tensor,
        stream: Stream,
        out: torch.Tensor | None = None,
        int8: bool = False,
    ) -> torch.Tensor:
        """y = x @ W^T for a quantized W [rows, k] and fp32 x [k] or [n_tok, k], n_tok <= 8.

        With ``int8`` (types in INT8_TYPES only) x is first rounded to int8 groups
        (``quantize_q8``) and multiplied with integer dot products: several times faster, and
        exact for the rounded x rather than x itself (relative error ~1e-3 of |W| @ |x|).

        Returns fp32 y [rows] or [n_tok, rows] (written into ``out`` when given). The kernel is
        queued on ``stream``; buffers must be ready on it (record/wait events across streams).
        Torch allocates ``out`` on torch's current stream, so call this under
        ``torch.cuda.stream(runtime.torch_stream(stream))``: the caching allocator then reuses
        the memory only after this stream's work, not another's.
        """
        from cuda.core import LaunchConfig, launch

        fmt = FORMATS.get(w.type_name)
        if fmt is None:
            raise ValueError(f"{w.name}: no CUDA matvec for type {w.type_name}")
        rows, k = w.rows, w.k
        if w.data.device != self.device or w.data.dtype != torch.uint8:
            raise ValueError(f"{w.name}: weight bytes must be uint8 on {self.device}")
        if (
            not w.data.is_contiguous()
            or w.data.numel() != rows * (k // fmt.block) * fmt.nbytes
            or w.data.data_ptr() % 16
        ):
            raise ValueError(f"{w.name}: weight bytes must be contiguous, 16-byte aligned, whole")
        if x.dim() not in (1, 2) or x.shape[-1] != k:
            raise ValueError(f"{w.name}: x has shape {list(x.shape)}, expected [{k}] or [n, {k}]")
        n_tok = 1 if x.dim() == 1 else x.shape[0]
        if not 1 <= n_tok <= MAX_MATVEC_TOKENS:
            raise ValueError(f"{w.name}: matvec takes 1..{MAX_MATVEC_TOKENS} tokens, got {n_tok}")
        _check_fp32_cuda("x", x, self.device)
        out_shape = (rows,) if x.dim() == 1 else (n_tok, rows)
        if out is None:
            out = torch.empty(out_shape, dtype=torch.float32, device=self.device)
        elif tuple(out.shape) != out_shape:
            raise ValueError(
                f"{w.name}: out has shape {list(out.shape)}, expected {list(out_shape)}"
            )
        _check_fp32_cuda("out", out, self.device)
        if int8:
            if w.type_name not in INT8_TYPES:
                raise ValueError(
                    f"{w.name}: no int8 matvec for type {w.type_name} "
                    f"(int8 types: {', '.join(sorted(INT8_TYPES))}); use int8=False"
                )
            xq = self.quantize_q8(x.reshape(n_tok, k), stream)
            self.matvec_q8(w, xq, stream, out.view(n_tok, rows))
            return out

        bucket = next(b for b in MATVEC_TOKEN_BUCKETS if b >= n_tok)
        kernel = self._kernel(MATVEC_SOURCE, f"matvec_{w.type_name}_t{bucket}")
        per_cta = self.tuning.rows_per_cta(bucket)
        grid = (rows + per_cta - 1) // per_cta
        config = LaunchConfig(grid=grid, block=32 * MATVEC_WARPS_PER_CTA)
        launch(
            stream,
            config,
            kernel,
            w.data.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            np.int32(rows),
            np.int32(k),
            np.int32(n_tok),
        )
        return out

    def quantize_q8(self, x: torch.Tensor, stream: Stream) -> Q8Activations:
        """Round fp32 x [n_tok, k] (k a multiple of 32) to int8 groups on ``stream``:
        d = max|x| / 127 per 32 values, q = roundf(x / d) (ties away from zero)."""
        from cuda.core import LaunchConfig, launch

        if x.dim() != 2 or x.shape[1] % Q8_GROUP:
            raise ValueError(f"x has shape {list(x.shape)}, expected [n_tok, k], k % 32 == 0")
        _check_fp32_cuda("x", x, self.device)
        n_tok, k = x.shape
        q = torch.empty(n_tok, k, dtype=torch.int8, device=self.device)  # [n_tok, k]
        d = torch.empty(n_tok, k // Q8_GROUP, dtype=torch.float32, device=self.device)
        n_groups = n_tok * k // Q8_GROUP
        groups_per_cta = Q8_THREADS // 32
        grid = (n_groups + groups_per_cta - 1) // groups_per_cta
        kernel = self._kernel(Q8_SOURCE, "quantize_q8")
        config = LaunchConfig(grid=grid, block=Q8_THREADS)
        launch(stream, config, kernel, x.data_ptr(), q.data_ptr(), d.data_ptr(), np.int32(n_groups))
        return Q8Activations(q, d)

    def matvec_q8(
        self, w: QuantWeight, xq: Q8Activations, stream: Stream, out: torch.Tensor
    ) -> torch.Tensor:
        """out [n_tok, rows] = xq @ W^T, W of a type in INT8_TYPES (validated by ``matvec``'s
        checks on the weight; call it through ``matvec(..., int8=True)`` unless x is shared)."""
        from cuda.core import LaunchConfig, launch

        if w.type_name not in INT8_TYPES:
            raise ValueError(f"{w.name}: no int8 matvec for type {w.type_name}")
        if xq.k != w.k or not 1 <= xq.n_tok <= MAX_MATVEC_TOKENS:
            raise ValueError(f"{w.name}: xq is [{xq.n_tok}, {xq.k}], expected [1..8, {w.k}]")
        if tuple(out.shape) != (xq.n_tok, w.rows):
            raise ValueError(f"{w.name}: out has shape {list(out.shape)}")
        _check_fp32_cuda("out", out, self.device)
        bucket = next(b for b in MATVEC_TOKEN_BUCKETS if b >= xq.n_tok)
        kernel = self._kernel(Q8_SOURCE, f"matvec_q8_{w.type_name}_t{bucket}")
        per_group = self.q8_rows[0] if bucket == 1 else self.q8_rows[1]
        per_cta = per_group * (Q8_THREADS // self.q8_group)
        config = LaunchConfig(grid=(w.rows + per_cta - 1) // per_cta, block=Q8_THREADS)
        args = (w.data.data_ptr(), xq.q.data_ptr(), xq.d.data_ptr(), out.data_ptr())
        launch(stream, config, kernel, *args, np.int32(w.rows), np.int32(w.k), np.int32(xq.n_tok))
        return out

    def spin(self, stream: Stream, nanoseconds: int) -> None:
        """Keep ``stream`` busy for ``nanoseconds`` of GPU time (tests, overlap measurements)."""
        from cuda.core import LaunchConfig, launch

        if nanoseconds < 0:
            raise ValueError(f"spin time must be >= 0 ns, got {nanoseconds}")
        kernel = self._kernel("util.cu", "spin_ns")
        launch(stream, LaunchConfig(grid=1, block=1), kernel, np.uint64(nanoseconds))
