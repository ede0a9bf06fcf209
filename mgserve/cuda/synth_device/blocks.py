"""Valid random GGUF blocks of every quant type the synthetic models use, at a realistic scale.

Quant blocks are random bytes except for their fp16 scale/min fields, which are set so that the
dequantized weights have a standard deviation of roughly ``WEIGHT_STD`` and mean ~0 (the
per-type constants in ``_RECIPES`` follow from each layout's value ranges, see there); float
tensors are normal with that std.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

WEIGHT_STD = 0.03  # target std of every random matrix (an initialised model's magnitude)


@dataclass(frozen=True)
class _Recipe:
    """How to make valid random blocks of one quant type."""

    fields: tuple[int, ...]  # byte offsets of the fp16 scale (and min) fields in a block
    d: float  # centre of the block scale d; each block draws d * U[0.5, 1.5)
    min_ratio: float = 0.0  # the min field is min_ratio * d (centres the block's values on 0)


# d per type: WEIGHT_STD / (std of the integer factor that multiplies d), with random payload
# bytes; the min field (where there is one) cancels the mean of the unsigned quants.
_RECIPES: dict[str, _Recipe] = {
    "Q4_0": _Recipe((0,), 6.5e-3),  # d (q - 8), q 0..15: std 4.6 d
    "Q4_1": _Recipe((0, 2), 6.5e-3, -7.5),  # d q + m, q 0..15
    "Q5_0": _Recipe((0,), 3.3e-3),  # d (q - 16), q 0..31: std 9.2 d
    "Q5_1": _Recipe((0, 2), 3.3e-3, -15.5),  # d q + m, q 0..31
    "Q8_0": _Recipe((0,), 4.0e-4),  # d q, q int8: std 74 d
    "IQ4_NL": _Recipe((0,), 4.5e-4),  # d kvalue[q]: std ~66 d
    "IQ4_XS": _Recipe((0,), 2.5e-5),  # d (ls - 32) kvalue[q]: std ~1200 d
    "Q2_K": _Recipe((80, 82), 2.0e-3, 1.5),  # d (s & 15) q - dmin (s >> 4), q 0..3
    "Q3_K": _Recipe((108,), 7.0e-4),  # d (s - 32) q, s 6-bit, q -4..3: std ~42 d
    "Q4_K": _Recipe((0, 2), 1.25e-4, 7.5),  # d sc q - dmin m, sc/m 6-bit, q 0..15
    "Q5_K": _Recipe((0, 2), 6.5e-5, 15.5),  # d sc q - dmin m, q 0..31
    "Q6_K": _Recipe((208,), 2.2e-5),  # d sc (q - 32), sc int8, q 0..63: std ~1370 d
}
_FLOATS: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def supported_types() -> frozenset[str]:
    """GGML type names ``synth_weight`` / ``SynthFile`` can make data for."""
    return frozenset(_RECIPES) | frozenset(_FLOATS)


def block_bytes(type_name: str) -> int:
    """Bytes of one GGUF block of ``type_name`` (one element for float types)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]


def make_blocks(
    type_name: str, n_blocks: int, device: torch.device | str, generator: torch.Generator | None
) -> torch.Tensor:
    """uint8 [n_blocks, block bytes]: valid random blocks (elements, for float types) on
    ``device``, made with ``generator`` (which must live on that device)."""
    dev = torch.device(device)
    if type_name in _FLOATS:
        values = torch.randn(n_blocks, generator=generator, device=dev) * WEIGHT_STD
        raw = values.to(_FLOATS[type_name]).view(torch.uint8)
        return raw.view(n_blocks, block_bytes(type_name))
    recipe = _RECIPES.get(type_name)
    if recipe is None:
        raise ValueError(
            f"no synthetic data generator for GGML type {type_name} "
            f"(supported: {', '.join(sorted(supported_types()))})"
        )
    size = block_bytes(type_name)
    blocks = torch.randint(
        0, 256, (n_blocks, size), dtype=torch.uint8, generator=generator, device=dev
    )  # [n_blocks, size]
    u = torch.rand(n_blocks, generator=generator, device=dev)  # [n_blocks]
    d = ((u + 0.5) * recipe.d).to(torch.float16)
    off = recipe.fields[0]
    blocks[:, off : off + 2] = d.view(torch.uint8).view(n_blocks, 2)
    if len(recipe.fields) > 1:
        off = recipe.fields[1]
        m = (d.float() * recipe.min_ratio).to(torch.float16)
        blocks[:, off : off + 2] = m.view(torch.uint8).view(n_blocks, 2)
    return blocks
