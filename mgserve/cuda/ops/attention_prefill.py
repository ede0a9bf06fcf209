"""``FlashPrefill``: prompt attention on ``kernels/attention_prefill.cu``, flash attention on
tensor cores over one slot of the q8_0 / f16 pools (f16 operands, fp32 accumulation and softmax:
about 1e-3 of a row's largest output), used by the attention family's and the QSA family's
prefill; and ``visibility``, the per-query bitmap of the positions a QSA prompt query attends
to, which lets QSA prompt queries run the same kernel.

A query's result depends only on its own query, position and the pool (the kernel's key tiles are
a fixed grid from position 0), never on the span's length or the step's other spans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.launch import Kernels
from mgserve.cuda.pools import KVLayer

if TYPE_CHECKING:
    from cuda.core import Kernel

PREFILL_SOURCE = "attention_prefill.cu"
SELECT_SOURCE = "qsa_select.cu"  # qsa_visibility
PF_THREADS = 128  # PF_THREADS in attention_prefill.cu
PF_ROWS = 64  # PF_ROWS: (query, head) rows per CTA
PF_KEYS = 32  # PF_KEYS: key positions per tile, one 32-bit visibility word
VIS_ELEMS = 1 << 26  # bound on the [queries, positions] mask built per group by ``visibility``


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_defines(d: int, k_q8: bool, v_q8: bool, smem: int) -> tuple[tuple[str, str], ...]:
    """The -D values of an attention kernel (attention.cu, attention_prefill.cu) for these pools;
    EXPECT_SMEM: the kernel static_asserts that its shared memory is the host's count."""
    return (
        ("HEAD_DIM", str(d)),
        ("K_Q8", str(int(k_q8))),
        ("V_Q8", str(int(v_q8))),
        ("EXPECT_SMEM", str(smem)),
    )


def prefill_smem_bytes(head_dim: int, k_q8: bool, v_q8: bool) -> int:
    """Dynamic shared memory of attn_prefill (SMEM_B in attention_prefill.cu, same formula): the
    f16 Q tile, then per operand the f16 tile + raw q8_0 values and scales, or two f16 tiles."""
    row = (head_dim + 8) * 2  # padded f16 row
    tile = PF_KEYS * row
    q8 = tile + PF_KEYS * head_dim + PF_KEYS * (head_dim // 32) * 2
    return PF_ROWS * row + (q8 if k_q8 else 2 * tile) + (q8 if v_q8 else 2 * tile)


def flash_defines(head_dim: int, k_q8: bool, v_q8: bool) -> tuple[tuple[str, str], ...]:
    """The -D values of attention_prefill.cu (attn_prefill) for these pools."""
    return kv_defines(head_dim, k_q8, v_q8, prefill_smem_bytes(head_dim, k_q8, v_q8))


def visibility_kernel(
    kernels: Kernels, sel: torch.Tensor, start: int, ratio: int, top: int
) -> torch.Tensor:  # [T, cdiv(start + T, 32)] int32
    """``visibility``'s bits from one kernel (qsa_visibility, ``kernels/qsa_select.cu``): one
    CTA per query, its selected blocks as a bitmap in shared memory."""
    t = sel.shape[0]
    words = cdiv(start + t, PF_KEYS)
    n_cols = cdiv(words * PF_KEYS, ratio)
    if sel.dtype != torch.int32 or sel.dim() != 2 or sel.shape[1] != top:
        raise ValueError(f"sel must be int32 [T, {top}], got {sel.dtype} {list(sel.shape)}")
    if cdiv(n_cols, 32) * 4 > 48 * 1024:  # the bitmap in dynamic shared memory, no opt-in
        raise ValueError(f"{n_cols} blocks is more than qsa_visibility's bitmap holds")
    out = torch.empty((t, words), dtype=torch.int32, device=sel.device)
    if t:
        sel = sel.contiguous()
        kernels.launch(
            kernels.kernel(SELECT_SOURCE, "qsa_visibility"),
            t,
            256,
            sel.data_ptr(),
            out.data_ptr(),
            np.int32(start),
            np.int32(ratio),
            np.int32(top),
            np.int32(words),
            np.int32(n_cols),
            shmem=cdiv(n_cols, 32) * 4,
        )
    return out


def visibility(
    sel: torch.Tensor,  # [T, top] int32 ascending selected blocks (dense rows: unused)
    start: int,  # query i sits at position start + i
    ratio: int,
    top: int,
) -> torch.Tensor:  # [T, cdiv(start + T, 32)] int32: bit p % 32 of word p // 32
    """The positions each QSA query attends to as bits: a sparse query (complete blocks > top)
    its selected blocks' cells and its tail complete * ratio .. p; a dense one 0 .. p
    (``qsa.positions``' rule). Built in groups of queries bounding the boolean mask, with torch
    ops (about 150 launches a group): the reference of ``visibility_kernel``."""
    t, dev = sel.shape[0], sel.device
    words = cdiv(start + t, PF_KEYS)
    n_pos = words * PF_KEYS
    pos = torch.arange(n_pos, device=dev)
    n_cols = cdiv(n_pos, ratio)
    blk = pos // ratio  # [P]
    out = torch.empty((t, words), dtype=torch.int32, device=dev)
    group = max(1, VIS_ELEMS // n_pos)
    for c0 in range(0, t, group):
        c1 = min(t, c0 + group)
        last = torch.arange(start + c0, start + c1, device=dev)  # [g] query positions
        complete = (last + 1) // ratio
        sparse = complete > top
        picked = torch.zeros((c1 - c0, n_cols + 1), dtype=torch.bool, device=dev)
        s = sel[c0:c1].long()
        picked.scatter_(1, torch.where(s >= 0, s, n_cols), True)  # -1 (dense rows): spare column
        chosen = picked[:, blk] | (pos[None, :] >= (complete * ratio)[:, None])
        vis = (pos[None, :] <= last[:, None]) & (chosen | ~sparse[:, None])  # [g, P]
        bits = vis.view(c1 - c0, words, PF_KEYS)
        packed = torch.zeros((c1 - c0, words), dtype=torch.int64, device=dev)
        for b in range(PF_KEYS):
            packed |= bits[:, :, b].long() << b
        out[c0:c1] = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return out


class FlashPrefill:
    """attn_prefill launches on checked, kernel-ready arguments (the families check them)."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self.device = kernels.device

    def _kernel(self, d: int, k_q8: bool, v_q8: bool) -> tuple[Kernel, int]:
        smem = prefill_smem_bytes(d, k_q8, v_q8)
        kern = self.kernels.kernel(
            PREFILL_SOURCE, "attn_prefill", flash_defines(d, k_q8, v_q8), smem=smem
        )
        return kern, smem

    def run(
        self,
        q: torch.Tensor,  # [T, H, D] contiguous float32, 16-byte aligned
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        vis: torch.Tensor | None = None,  # [T, cdiv(start + T, 32)] int32 (``visibility``)
    ) -> torch.Tensor:  # [T, H * D] float32
        """Query i (position start + i) over positions 0 .. start + i of ``slot`` (the last
        ``window`` of them if window > 0; those set in vis[i] if given)."""
        t, h, d = q.shape
        n_ctx, n_kv = k.values.shape[1], k.values.shape[2]
        out = torch.empty((t, h * d), dtype=torch.float32, device=self.device)
        if t == 0:
            return out
        assert q.is_contiguous() and q.data_ptr() % 16 == 0
        words = cdiv(start + t, PF_KEYS)
        if vis is not None:
            assert vis.dtype == torch.int32 and vis.is_contiguous()
            assert tuple(vis.shape) == (t, words)
        group = h // n_kv
        kern, smem = self._kernel(d, k.quantized, v.quantized)
        self.kernels.launch(
            kern,
            (cdiv(t * group, PF_ROWS), n_kv),
            PF_THREADS,
            q.data_ptr(),
            k.values.data_ptr(),
            k.scales.data_ptr() if k.quantized else 0,
            v.values.data_ptr(),
            v.scales.data_ptr() if v.quantized else 0,
            vis.data_ptr() if vis is not None else 0,
            out.data_ptr(),
            np.int32(slot),
            np.int32(start),
            np.int32(t),
            np.int32(n_ctx),
            np.int32(n_kv),
            np.int32(group),
            np.float32(scale),
            np.float32(softcap),
            np.int32(window),
            np.int32(words),
            shmem=smem,
        )
        return out
