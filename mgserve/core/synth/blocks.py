"""Random but well-formed tensor bytes for synthetic GGUF files, produced at disk speed.

A synthetic model only has to load and run without NaN/inf from its weights, so quant blocks are
random bytes, except their fp16 scale/min fields, which are written explicitly as small finite
values (random bytes would give inf/NaN halves about 1 time in 32). Block layouts (bytes):

    Q4_0  18: f16 d | 16 nibbles            Q4_1  20: f16 d, f16 m | 16 nibbles
    Q5_0  22: f16 d | u32 qh | 16 nibbles   Q5_1  24: f16 d, f16 m | u32 qh | 16 nibbles
    Q8_0  34: f16 d | 32 x i8               Q2_K  84: 16 scales | 64 q | f16 d, f16 dmin
    Q3_K 110: 32 hmask | 64 q | 12 scales | f16 d
    Q4_K 144: f16 d, f16 dmin | 12 bytes 6-bit scales/mins | 128 nibbles
    Q5_K 176: f16 d, f16 dmin | 12 scales | 32 qh | 128 nibbles
    Q6_K 210: 128 ql | 64 qh | 16 x i8 scales | f16 d

Generating fresh randomness for tens of GB would be CPU-bound, so each type gets one random pool
(a few MiB of valid blocks) and a tensor is written as pool slices from a random block-aligned
start, wrapping around: tensors differ, bytes stay valid, and writing runs at disk speed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# byte offsets of the fp16 scale/min fields inside one block
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
FLOAT_TYPES: dict[GGMLQuantizationType, str] = {Q.F32: "<f4", Q.F16: "<f2", Q.BF16: "bf16"}

# per type: large enough that repeats are far apart, small enough to build in milliseconds
POOL_BYTES = 8 << 20
CHUNK_BYTES = 32 << 20  # bytes handed to the writer per call


def supported(ggml_type: GGMLQuantizationType) -> bool:
    return ggml_type in FP16_FIELDS or ggml_type in FLOAT_TYPES


def _float_pool(ggml_type: GGMLQuantizationType, n: int, rng: np.random.Generator) -> np.ndarray:
    # small weights (std 0.02, like an initialised model) keep activations of a random net finite
    values = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
    if ggml_type == Q.BF16:
        return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    return values.astype(FLOAT_TYPES[ggml_type]).view(np.uint8)


def make_pool(
    ggml_type: GGMLQuantizationType, rng: np.random.Generator, n_bytes: int = POOL_BYTES
) -> np.ndarray:
    """A flat uint8 array of whole, valid blocks (or float elements) of ``ggml_type``."""
    if not supported(ggml_type):
        raise ValueError(f"no synthetic data generator for GGML type {ggml_type.name}")
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = max(1, n_bytes // type_size)
    if ggml_type in FLOAT_TYPES:
        return _float_pool(ggml_type, n_blocks, rng)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)  # [n_blocks, size]
    for i, off in enumerate(FP16_FIELDS[ggml_type]):
        # d in [1e-4, 1e-3): dequantized weights stay below ~1; mins (second field) smaller still
        hi = 1e-3 if i == 0 else 5e-4
        scale = rng.uniform(1e-4, hi, size=n_blocks).astype("<f2")  # [n_blocks]
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


class BlockSource:
    """Hands out tensor bytes of any supported type from per-type random pools."""

    def __init__(self, seed: int, pool_bytes: int = POOL_BYTES) -> None:
        self._rng = np.random.default_rng(seed)
        self._pool_bytes = pool_bytes
        self._pools: dict[GGMLQuantizationType, np.ndarray] = {}

    def chunks(self, ggml_type: GGMLQuantizationType, n_bytes: int) -> Iterator[memoryview]:
        """``n_bytes`` of valid ``ggml_type`` data as memoryviews of at most ``CHUNK_BYTES``."""
        pool = self._pools.get(ggml_type)
        if pool is None:
            pool = self._pools[ggml_type] = make_pool(ggml_type, self._rng, self._pool_bytes)
        unit = GGML_QUANT_SIZES[ggml_type][1]
        n_units = len(pool) // unit
        pos = int(self._rng.integers(0, n_units)) * unit  # block-aligned start, differs per tensor
        view = pool.data  # memoryview: slices are zero-copy
        left = n_bytes
        while left > 0:
            n = min(left, len(pool) - pos, CHUNK_BYTES)
            yield view[pos : pos + n]
            left -= n
            pos = (pos + n) % len(pool)
