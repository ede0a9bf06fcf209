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

    def __init__(self, compiler: KernelCompiler, tuning: MatvecTuning | None = None) -> None:
        self.compiler = compiler
        self.tuning = tuning or MatvecTuning()
        self._matvec_opts = compiler.options(defines=self.tuning.defines())
        self.device = torch.device("cuda", compiler.device_index)
        self._kernels: dict[str, Kernel] = {}

    def _kernel(self, source: str, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            opts = self._matvec_opts if source == MATVEC_SOURCE else None
            k = self._kernels[name] = self.compiler.kernel(source, name, opts)
        return k

    def matvec(
        self,
        w: QuantWeight,
        x: torch.Tensor,
        stream: Stream,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = x @ W^T for a quantized W [rows, k] and fp32 x [k] or [n_tok, k], n_tok <= 8.

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

    def spin(self, stream: Stream, nanoseconds: int) -> None:
        """Keep ``stream`` busy for ``nanoseconds`` of GPU time (tests, overlap measurements)."""
        from cuda.core import LaunchConfig, launch

        if nanoseconds < 0:
            raise ValueError(f"spin time must be >= 0 ns, got {nanoseconds}")
        kernel = self._kernel("util.cu", "spin_ns")
        launch(stream, LaunchConfig(grid=1, block=1), kernel, np.uint64(nanoseconds))
