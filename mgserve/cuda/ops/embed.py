"""The embed family: rows of a float32 table gathered by index (a step's token embeddings, read
on the device so decode needs no host lookup), scaled (Gemma's sqrt(d)), and for qwen4exp copied
into every hyper-connection stream.

``EmbedTorch`` is the reference's ``tok_embd[tokens]`` (``* scale``, ``.repeat`` into streams);
``EmbedCuda`` does it in one launch of kernels/embed.cu. Both are static-shape and sync-free.
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.checks import check_cuda, check_f32, shape_error
from mgserve.cuda.launch import Kernels

EMBED_SOURCE = "embed.cu"
EMBED_THREADS = 256  # threads per CTA of embed_gather_*: one float4 (or float) each


def check_gather(table: torch.Tensor, ids: torch.Tensor, streams: int) -> None:
    check_f32("table", table)
    if table.dim() != 2:
        raise shape_error("table", table, "[V, d]")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64 [N], got {ids.dtype} {list(ids.shape)}")
    if streams < 0:
        raise ValueError(f"streams must be >= 0, got {streams}")


class EmbedTorch:
    """The gather in PyTorch on the tensors' device."""

    def gather(
        self, table: torch.Tensor, ids: torch.Tensor, *, streams: int = 0, scale: float = 1.0
    ) -> torch.Tensor:
        """table [V, d] f32, ids [N] -> table[ids] * scale: [N, d], or with ``streams`` > 0
        [N, streams, d] (the row in every stream)."""
        check_gather(table, ids, streams)
        x = table.index_select(0, ids)  # [N, d]
        if scale != 1.0:
            x = x * scale
        return x if streams == 0 else x[:, None, :].repeat(1, streams, 1)


class EmbedCuda:
    """The gather on embed.cu; ids out of [0, V) are clamped (no host check in decode)."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self.device = kernels.device

    def gather(
        self, table: torch.Tensor, ids: torch.Tensor, *, streams: int = 0, scale: float = 1.0
    ) -> torch.Tensor:
        check_gather(table, ids, streams)
        check_cuda("table", table, self.device, torch.float32)
        check_cuda("ids", ids, self.device, ids.dtype)
        (v, d), n = table.shape, ids.shape[0]
        out = torch.empty((n, max(streams, 1), d), dtype=torch.float32, device=self.device)
        if n and d:
            vec = d % 4 == 0 and table.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
            per_row = d // 4 if vec else d
            name = f"embed_gather_{'i64' if ids.dtype == torch.int64 else 'i32'}"
            self.kernels.launch(
                self.kernels.kernel(EMBED_SOURCE, name + ("_v4" if vec else "")),
                (n, -(-per_row // EMBED_THREADS)),
                EMBED_THREADS,
                table.data_ptr(),
                ids.data_ptr(),
                out.data_ptr(),
                np.int32(v),
                np.int32(d),
                np.int32(max(streams, 1)),
                np.float32(scale),
            )
        return out if streams else out.view(n, d)
