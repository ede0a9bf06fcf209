"""GGUF tensors on the GPU in their quantized block layout (DESIGN.md: kernels read blocks).

An upload is the file's bytes, unchanged, in a torch uint8 tensor [rows, row_bytes], where a row is
the tensor's contiguous GGUF dimension (ne0, the matvec's k) and rows are everything else
(ne1 * ne2 * ...). No cuda.core here: torch allocates, kernels get the pointer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import numpy as np
import torch

from mgserve.core.gguf.reader import TensorInfo


class BlockFormat(NamedTuple):
    block: int  # values per block (8 for plain element types: one kernel run)
    nbytes: int  # bytes per block


# The formats the matvec, dequant and MoE kernels read (layouts: the table in
# kernels/gguf_blocks.cuh).
FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat(32, 18),
    "Q4_1": BlockFormat(32, 20),
    "Q5_0": BlockFormat(32, 22),
    "Q5_1": BlockFormat(32, 24),
    "Q8_0": BlockFormat(32, 34),
    "IQ4_NL": BlockFormat(32, 18),
    "Q4_K": BlockFormat(256, 144),
    "Q5_K": BlockFormat(256, 176),
    "Q6_K": BlockFormat(256, 210),
    "IQ4_XS": BlockFormat(256, 136),
    "F32": BlockFormat(8, 32),
    "F16": BlockFormat(8, 16),
    "BF16": BlockFormat(8, 16),
    # the low-bit formats of dynamic quants (kernels/gguf_blocks_lowbit.cuh, gguf_blocks_iq.cuh)
    "Q2_K": BlockFormat(256, 84),
    "Q3_K": BlockFormat(256, 110),
    "MXFP4": BlockFormat(32, 17),
    "IQ2_XXS": BlockFormat(256, 66),
    "IQ2_XS": BlockFormat(256, 74),
    "IQ2_S": BlockFormat(256, 82),
    "IQ3_XXS": BlockFormat(256, 98),
    "IQ3_S": BlockFormat(256, 110),
    "IQ1_S": BlockFormat(256, 50),
    "IQ1_M": BlockFormat(256, 56),
}


@dataclass(frozen=True)
class QuantWeight:
    name: str  # GGUF tensor name, for error messages
    type_name: str  # GGML type name, a key of FORMATS
    shape: tuple[int, ...]  # GGUF order: shape[0] = k (contiguous), shape[1:] multiply to rows
    data: torch.Tensor  # uint8 [rows, row_bytes] on the GPU, the file's bytes

    @property
    def k(self) -> int:
        return self.shape[0]

    @property
    def rows(self) -> int:
        return prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def row_bytes(name: str, type_name: str, k: int) -> int:
    """Bytes of one row of ``k`` values; ValueError if the type or the width cannot be read."""
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise ValueError(
            f"tensor {name!r} has type {type_name}, which the CUDA kernels do not support "
            f"(supported: {', '.join(sorted(FORMATS))})"
        )
    if k <= 0 or k % fmt.block:
        raise ValueError(
            f"tensor {name!r} ({type_name}): row width {k} is not a positive multiple of "
            f"{fmt.block} (the CUDA matvec reads whole {fmt.block}-value runs)"
        )
    return k // fmt.block * fmt.nbytes


def upload_bytes(
    name: str,
    type_name: str,
    shape: tuple[int, ...],
    raw: np.ndarray,
    device: torch.device | str = "cuda",
) -> QuantWeight:
    """Copy a tensor's raw GGUF bytes (any dtype view of them) to ``device`` as a QuantWeight."""
    if not shape:
        raise ValueError(f"tensor {name!r} has no dimensions")
    rb = row_bytes(name, type_name, shape[0])
    rows = prod(shape[1:])
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.size != rows * rb:
        raise ValueError(
            f"tensor {name!r} ({type_name}, shape {list(shape)}): {flat.size} bytes of data, "
            f"expected {rows * rb}"
        )
    with warnings.catch_warnings():  # a read-only memory map: torch only reads it here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        host = torch.from_numpy(flat).reshape(rows, rb)  # [rows, row_bytes]
    data = host.to(device, non_blocking=False)
    return QuantWeight(name=name, type_name=type_name, shape=tuple(shape), data=data)


def upload(t: TensorInfo, device: torch.device | str = "cuda") -> QuantWeight:
    """One GGUF tensor (memory-mapped) to the GPU in its block layout."""
    return upload_bytes(t.name, t.type_name, t.shape, np.asarray(t.data), device)
