"""GGUF tensor -> float32 torch tensor, through gguf-py's ``quants.dequantize`` (the reference).

The reference path dequantizes every weight once, at load. The token embedding is dequantized whole
too (Gemma 3 270M: 262144 x 640 Q8_0 -> 671 MB of float32): the tied output projection needs all of
it at every step, so keeping it quantized would only move the cost into each forward.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from mgserve.core.gguf.reader import GGUFError, GGUFFile, TensorInfo

# Types the reference path reads. F32/F16 are stored as plain elements; the rest are block formats
# that gguf-py decodes in numpy (the last line: the low-bit types dynamic quants use; gguf-py
# carries their IQ grids). Others (TQ1_0, TQ2_0, NVFP4, ...) are refused: no file we serve has them.
SUPPORTED_TYPES = frozenset(
    {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
        "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
    }
)  # fmt: skip


def dequantize(g: GGUFFile, t: TensorInfo) -> torch.Tensor:
    """The tensor as float32 in torch order: GGUF shape (ne0, ne1, ...) becomes (..., ne1, ne0)."""
    if t.type_name not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{g.path}: tensor {t.name!r} has type {t.type_name}, which the reference path does "
            f"not support (supported: {', '.join(sorted(SUPPORTED_TYPES))})"
        )
    qtype = GGMLQuantizationType(t.type_id)
    if t.type_name == "F32":
        values = np.array(t.data, dtype=np.float32)
    elif t.type_name == "F16":
        values = np.asarray(t.data).astype(np.float32)
    else:
        values = quants.dequantize(np.asarray(t.data), qtype)
    shape = tuple(reversed(t.shape))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


def load_tensor(g: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize ``name`` after checking its GGUF shape (ne0 first, as llama.cpp writes it)."""
    t = g.tensor(name)
    if t.shape != shape:
        raise GGUFError(
            f"{g.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
        )
    return dequantize(g, t)
