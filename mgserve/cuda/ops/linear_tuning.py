"""Compile-time shapes of the linear family's kernels, and the int8 activations they share.

``MatvecTuning`` and the q8 row counts are -D macros of matvec.cu / matvec_q8.cu, measured on the
H200 by ``mgserve bench matvec``; ``Q8Activations`` is an activation rounded to int8 groups once
and read by every int8 product of the same x (linear and MoE decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MATVEC_SOURCE = "matvec.cu"
MATVEC_WARPS_PER_CTA = 4  # WARPS_PER_CTA in matvec.cu
MATVEC_TOKEN_BUCKETS = (1, 2, 4, 8)  # the kernel's NT instances; a call uses the smallest fit
MAX_MATVEC_TOKENS = MATVEC_TOKEN_BUCKETS[-1]
Q8_SOURCE = "matvec_q8.cu"
Q8_THREADS = 128  # Q8_THREADS in matvec_q8.cu: threads per CTA of the int8 kernels
Q8_GROUP = 32  # activation values per int8 scale
Q8MMA_ROWS = 8  # Q8MMA_ROWS in matvec_q8.cu: rows per CTA of the int8-mma kernels
INT8_TYPES = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0"})  # formats with an int8-activation kernel
Q8_ROWS = (2, 2)  # LinearQ8's default rows per thread group, one token and 2..8 (Q8_ROWS_1 / _N)


def q8_defines(rows: tuple[int, int], group: int) -> tuple[tuple[str, str], ...]:
    """The -D macros of matvec_q8.cu for ``LinearQ8``'s shape (rows, group threads)."""
    return (
        ("Q8_ROWS_1", str(rows[0])),
        ("Q8_ROWS_N", str(rows[1])),
        ("Q8_GROUP_THREADS", str(group)),
    )


def token_bucket(n: int) -> int:
    """The matvec kernels' token instance (NT, a MATVEC_TOKEN_BUCKETS entry) for n <= 8 tokens."""
    return next(b for b in MATVEC_TOKEN_BUCKETS if b >= n)


def q8_rows(n: int, k: int) -> bool:
    """Whether int8 kernels take [n, k] activations: 1..8 tokens, whole groups of 32."""
    return 1 <= n <= MAX_MATVEC_TOKENS and k % Q8_GROUP == 0


@dataclass(frozen=True)
class Q8Activations:
    """Activations rounded to int8 for the int8 matvec: x ~= d * q per group of 32 values.

    Made once per input vector by ``LinearCuda.quantize`` and reusable by every matvec that reads
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
        for name, most in (("rows_per_warp_1", 8), ("rows_per_warp_n", 8), ("unroll", 16)):
            if not 1 <= getattr(self, name) <= most:
                raise ValueError(
                    f"MatvecTuning.{name} must be in 1..{most}, got {getattr(self, name)}"
                )

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
