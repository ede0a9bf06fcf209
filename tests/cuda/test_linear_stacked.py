"""``matmul_stacked`` (cuda/ops/linear_stacked.py): which products share one GEMM launch. The
bits (stacked == one GEMM a weight) are test_hc.py's GPU test
``test_prompt_mix_stacks_inject_bitwise``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from mgserve.cuda.ops.hgemm import HGemmTuning
from mgserve.cuda.ops.linear_cuda import SCRATCH_BYTES
from mgserve.cuda.ops.linear_stacked import matmul_stacked, stacks


def fake_linear(decode_rows: int = 8) -> Any:
    """A LinearCuda stand-in: its settings, and a ``matmul`` that records each weight."""
    seen: list[str] = []
    return SimpleNamespace(
        hgemm=SimpleNamespace(tuning=HGemmTuning()),
        path=SimpleNamespace(decode_kernels=lambda n: n <= decode_rows),
        prefill_exact=False,
        cublas_prefill=False,
        matmul=lambda x, w: seen.append(w.name) or torch.zeros(x.shape[0], w.rows),
        seen=seen,
    )


def weight(name: str, rows: int, k: int) -> Any:
    return SimpleNamespace(name=name, rows=rows, k=k)


def test_what_stacks() -> None:
    lin = fake_linear()
    down, inject = weight("down", 320, 10240), weight("inject", 4, 10240)
    n = HGemmTuning().min_rows
    assert stacks(lin, n, (down, inject))
    assert not stacks(lin, n - 1, (down, inject))  # qgemm.cu decodes W per tile: no shared tile
    assert not stacks(lin, n, (down,))
    assert not stacks(lin, n, (down, weight("other k", 4, 2560)))
    assert not stacks(lin, n, (down, weight("huge", SCRATCH_BYTES // (2 * 10240), 10240)))
    assert not stacks(fake_linear(decode_rows=10**6), n, (down, inject))  # decode kernels
    for flag in ("prefill_exact", "cublas_prefill"):
        other = fake_linear()
        setattr(other, flag, True)
        assert not stacks(other, n, (down, inject)), flag


def test_unstacked_products_are_one_matmul_each() -> None:
    lin = fake_linear()
    down, inject = weight("down", 320, 10240), weight("inject", 4, 10240)
    outs = matmul_stacked(lin, torch.zeros(3, 10240), (down, inject))  # 3 rows: decode kernels
    assert lin.seen == ["down", "inject"] and [o.shape[1] for o in outs] == [320, 4]
