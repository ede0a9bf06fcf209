"""QSA prompt selection on the GPU (``QsaCuda.prefill``'s first part): each prompt query's
``top`` blocks among the complete ones, scored by one fp32 cuBLAS matmul per group of
``QsaCuda.score_group`` queries (each block key reused across the group's queries), the heads' relus
summed by ``qsa_head_sum`` and selected by ``qsa_select`` (``kernels/qsa_select.cu``): three
launches a group (the torch ops of the heads' sum were about half of a 4096-token qwen4exp
chunk's 13,000 launches)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from mgserve.core.reference import rowwise
from mgserve.cuda.launch import MAX_GRID_Y, Kernels
from mgserve.cuda.ops.attention_prefill import cdiv

if TYPE_CHECKING:
    from mgserve.cuda.ops.qsa_cuda import QsaCuda

SELECT_SOURCE = "qsa_select.cu"
# queries per QSA prefill score product (the default of QsaCuda's): 256 against 64, a 4096-token
# qwen4exp chunk at depth 32768 +3.8% (+3.1% to +4.0%, paired 3, H100, BENCHMARKS.md 2026-12-07
# 23:10; a quarter of the launches); the bits do not depend on it (test_qsa.py)
QSA_SCORE_GROUP = 256


def head_sum(kernels: Kernels, prod: torch.Tensor, norm: float) -> torch.Tensor:
    """[N, stride] float32 QSA scores from the heads' products ``prod`` [N, H_idx, stride]
    (stride % 4 == 0, contiguous): sum_h relu(prod[:, h]) / norm, heads in order (kernel)."""
    n, n_hi, stride = prod.shape
    assert stride % 4 == 0 and prod.is_contiguous() and prod.dtype == torch.float32
    assert n <= MAX_GRID_Y, "rows go on the grid's y dimension"
    scores = torch.empty((n, stride), dtype=torch.float32, device=prod.device)
    if n:
        kernels.launch(
            kernels.kernel(SELECT_SOURCE, "qsa_head_sum"),
            (cdiv(stride // 4, 256), n),
            256,
            prod.data_ptr(),
            scores.data_ptr(),
            np.int32(stride // 4),
            np.int32(n_hi),
            np.float32(norm),
        )
    return scores


def prefill_select(
    qsa: QsaCuda,
    iq: torch.Tensor,  # [T, H_idx, D_idx]
    blocks: torch.Tensor,  # [n_slots, n_ctx / ratio, D_idx]
    slot: int,
    lengths: torch.Tensor,  # [T] int32: query j at lengths[j] - 1
    n_blk: int,  # blocks complete by the last query
    ratio: int,
    top: int,
) -> torch.Tensor:  # [T, top] int32
    """QSA prefill selection: every query of the chunk scored against the complete blocks by
    one fp32 matmul per group of ``qsa.score_group`` queries (cuBLAS reuses each block key
    across queries), then per group one kernel for the heads' relu sum (``head_sum``) and
    one for the selection (qsa_select): three launches a group. The last group is
    zero-padded to the full size, so every product has one shape and a query's scores do
    not depend on how many queries share its span (cuBLAS picks its algorithm by shape).
    Scores of blocks a query cannot see yet are computed but never read (the kernel reads
    blocks < lengths / ratio only)."""
    t, n_hi, di = iq.shape
    stride = cdiv(n_blk, 4) * 4
    bl = blocks[slot, : min(stride, blocks.shape[1])]  # [<= stride, D_idx]
    if bl.shape[0] < stride:
        bl = F.pad(bl, (0, 0, 0, stride - bl.shape[0]))
    blt = bl.t()  # [D_idx, stride]
    iq = iq.contiguous()
    sel = torch.empty((t, top), dtype=torch.int32, device=qsa.device)
    group, norm = qsa.score_group, float(np.float32(math.sqrt(di)))
    for c0 in range(0, t, group):
        c1 = min(t, c0 + group)
        part = iq[c0:c1]
        if c1 - c0 < group:  # the last one padded
            part = F.pad(part, (0, 0, 0, 0, 0, group - (c1 - c0)))
        prod = torch.matmul(part.reshape(-1, di), blt)  # [group * H_idx, stride]
        prod = prod.view(group, n_hi, stride)[: c1 - c0]
        if qsa.prefill_kernels:
            scores = head_sum(qsa.kernels, prod, norm)
        else:  # the torch ops it replaced (bench model --toggle qsa.prefill_kernels)
            scores = rowwise.sum_in_order(prod.relu(), 1).div_(norm)
        qsa.select(scores, lengths[c0:c1], n_blk, ratio, top, out=sel[c0:c1])
    return sel
