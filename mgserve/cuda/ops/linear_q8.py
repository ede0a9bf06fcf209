"""``LinearQ8``: the int8-activation products of the linear family (matvec_q8.cu): fp32
activations rounded to int8 per 32 values (``quantize``, once per activation: ``Q8Activations``),
then each quantized W read once with integer dot products (``matvec``: dp4a for one token,
int8 tensor-core tiles for 2..8, giving each token the bits it gets alone), a bias and a residual
added as each output is written. ``LinearCuda`` (linear_cuda.py) calls them in decode with
``int8``; ``MoeCuda`` rounds its expert inputs here too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.checks import check_cuda, check_vec4
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.linear_tuning import (
    INT8_TYPES,
    MAX_MATVEC_TOKENS,
    Q8_GROUP,
    Q8_ROWS,
    Q8_SOURCE,
    Q8_THREADS,
    Q8MMA_ROWS,
    Q8Activations,
    q8_defines,
    token_bucket,
)
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from cuda.core import Stream


def epilogue_ptrs(
    w: QuantWeight, out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
    device: torch.device,
) -> tuple[int, int]:  # fmt: skip
    """The kernels' (bias, res) pointers, 0 where absent, after checking both."""
    for name, t, shape in (("bias", bias, (w.rows,)), ("residual", residual, out.shape)):
        if t is not None:
            check_cuda(name, t, device, torch.float32)
            if t.shape != shape:
                raise ValueError(f"{w.name}: {name} has shape {list(t.shape)}")
    return (0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr())


class LinearQ8:
    """The int8 kernels with their shape: ``rows``, output rows per thread group for one token
    and for 2..8; ``group``, threads sharing those rows, 32 (a warp) or 128 (the CTA): the
    Q8_ROWS_1 / Q8_ROWS_N / Q8_GROUP_THREADS macros of matvec_q8.cu, measured by
    ``bench matvec --q8-rows``. ``mma``: 2..8 tokens take the tensor-core kernels
    (matvec_q8mma_*, the same bits as the dp4a ones; only with ``group`` 128, whose reduction
    order they mirror). Off by default: on the H200 (2026-12-03) they were slower than dp4a for
    5 tokens (Q4_K 10240 x 2560: 36.3 us against 25.0; in a full-width decode step 5.29 ms
    against 2.81), so ``bench matvec --q8-mma on,off`` keeps them measurable."""

    def __init__(
        self,
        kernels: Kernels,
        rows: tuple[int, int] = Q8_ROWS,
        group: int = Q8_THREADS,
        mma: bool = False,
    ) -> None:
        if len(rows) != 2 or not all(1 <= r <= 8 for r in rows):
            raise ValueError(f"q8_rows must be two row counts in 1..8, got {rows}")
        if group not in (32, Q8_THREADS):
            raise ValueError(f"q8_group must be 32 or {Q8_THREADS}, got {group}")
        self.kernels, self.device = kernels, kernels.device
        self.rows, self.group = rows, group
        self._offered = threading.local()  # offer's (x, its version, xq), per thread
        self.mma = mma and group == Q8_THREADS
        self.defines = q8_defines(rows, group)

    def offer(self, x: torch.Tensor, xq: Q8Activations) -> None:
        """x's int8 form, written by x's producer as ``quantize`` rounds (the clustered HC mix):
        ``offered(x)`` returns it while x is the same tensor with no torch write since (its
        version counter; a kernel writing through its pointer does not count: none writes a
        mix's output); this thread's last offer, held until the next."""
        if not x.is_inference():  # (inference tensors keep no version counter)
            self._offered.entry = (x, x._version, xq)

    def offered(self, x: torch.Tensor) -> Q8Activations | None:
        """The int8 form offered for x (``offer``), or None."""
        entry = getattr(self._offered, "entry", None)
        if entry is not None and entry[0] is x and entry[1] == x._version:
            return entry[2]  # type: ignore[no-any-return]
        return None

    def empty(self, n_tok: int, k: int) -> Q8Activations:
        """Room for [n_tok, k] rounded to int8 (k % 32 == 0), for a producer that writes it."""
        q = torch.empty(n_tok, k, dtype=torch.int8, device=self.device)
        d = torch.empty(n_tok, k // Q8_GROUP, dtype=torch.float32, device=self.device)
        return Q8Activations(q, d)

    def quantize(self, x: torch.Tensor, stream: Stream | None = None) -> Q8Activations:
        """Round fp32 x [n_tok, k] (k a multiple of 32) to int8 groups on ``stream``:
        d = max|x| / 127 per 32 values, q = roundf(x / d) (ties away from zero)."""
        if x.dim() != 2 or x.shape[1] % Q8_GROUP:
            raise ValueError(f"x has shape {list(x.shape)}, expected [n_tok, k], k % 32 == 0")
        check_vec4("x", x, self.device, torch.float32)
        n_tok, k = x.shape
        q = torch.empty(n_tok, k, dtype=torch.int8, device=self.device)  # [n_tok, k]
        d = torch.empty(n_tok, k // Q8_GROUP, dtype=torch.float32, device=self.device)
        n_groups = n_tok * k // Q8_GROUP
        groups_per_cta = Q8_THREADS // 32
        grid = (n_groups + groups_per_cta - 1) // groups_per_cta
        kernel = self.kernels.kernel(Q8_SOURCE, "quantize_q8", self.defines)
        args = (x.data_ptr(), q.data_ptr(), d.data_ptr(), np.int32(n_groups))
        self.kernels.launch(kernel, grid, Q8_THREADS, *args, stream=stream)
        return Q8Activations(q, d)

    def matvec(
        self, w: QuantWeight, xq: Q8Activations, stream: Stream | None, out: torch.Tensor,
        bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """out [n_tok, rows] = residual + (xq @ W^T + bias), W of a type in INT8_TYPES
        (validated by ``matvec``'s checks on the weight; call it through ``LinearCuda.matvec``)."""
        if w.type_name not in INT8_TYPES:
            raise ValueError(f"{w.name}: no int8 matvec for type {w.type_name}")
        if xq.k != w.k or not 1 <= xq.n_tok <= MAX_MATVEC_TOKENS:
            raise ValueError(f"{w.name}: xq is [{xq.n_tok}, {xq.k}], expected [1..8, {w.k}]")
        if tuple(out.shape) != (xq.n_tok, w.rows):
            raise ValueError(f"{w.name}: out has shape {list(out.shape)}")
        check_vec4("out", out, self.device, torch.float32)
        tail = epilogue_ptrs(w, out, bias, residual, self.device)
        bucket = token_bucket(xq.n_tok)
        family = "q8mma" if self.mma and bucket > 1 else "q8"
        kernel = self.kernels.kernel(
            Q8_SOURCE, f"matvec_{family}_{w.type_name}_t{bucket}", self.defines
        )
        if family == "q8mma":
            per_cta = Q8MMA_ROWS
        else:
            per_group = self.rows[0] if bucket == 1 else self.rows[1]
            per_cta = per_group * (Q8_THREADS // self.group)
        args = (w.data.data_ptr(), xq.q.data_ptr(), xq.d.data_ptr(), out.data_ptr())
        self.kernels.launch(
            kernel, (w.rows + per_cta - 1) // per_cta, Q8_THREADS,
            *args, np.int32(w.rows), np.int32(w.k), np.int32(xq.n_tok), *tail, stream=stream,
        )  # fmt: skip
        return out
