"""Host values for the small tensors that random weights would break (norm gammas, ``ssm_a``,
the dt bias, conv taps), chosen per kind as the HF initialisations choose them, so a forward pass
over a synthetic model stays finite and sane."""

from __future__ import annotations

import math
import re
from math import prod

import numpy as np

from mgserve.cuda.synth_device.blocks import WEIGHT_STD


def tensor_kind(name: str) -> str:
    """``blk.3.attn_norm.weight`` -> ``attn_norm``; ``blk.0.ssm_a`` -> ``ssm_a``."""
    name = re.sub(r"^blk\.\d+\.", "", name)
    return re.sub(r"\.(weight|bias)$", "", name)


_NORM = re.compile(r"(^|[._])norm($|[._])")


def special_values(
    kind: str, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray | None:
    """float32 values in reversed ``shape`` for tensors that random weights would break, else
    None (then the tensor takes pool values like any weight)."""
    n = prod(shape)
    if _NORM.search(kind):  # RMSNorm gammas, stored with any "1 +" folded in: near 1
        v = 1.0 + WEIGHT_STD * rng.standard_normal(n)
    elif kind == "ssm_a":  # -exp(A_log), A ~ U[1, 16] as the HF init
        v = -rng.uniform(1.0, 16.0, n)
    elif kind == "ssm_dt":  # dt bias: softplus^-1 of dt ~ logU[1e-3, 1e-1] (HF init)
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
        v = dt + np.log(-np.expm1(-dt))
    elif kind in ("ssm_conv1d", "ple_conv1d"):  # depthwise taps: U(+-1/sqrt(K)), K = shape[0]
        bound = 1.0 / math.sqrt(shape[0])
        v = rng.uniform(-bound, bound, n)
    else:
        return None
    return v.astype(np.float32).reshape(tuple(reversed(shape)))


def encode_floats(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values -> flat uint8 bytes of ``type_name`` (F32, F16 or BF16)."""
    if type_name == "F32":
        return values.astype("<f4").reshape(-1).view(np.uint8)
    if type_name == "F16":
        return values.astype("<f2").reshape(-1).view(np.uint8)
    if type_name == "BF16":  # round to nearest even on the dropped 16 bits
        raw = values.astype("<f4").reshape(-1).view(np.uint32).astype(np.uint64)
        rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        return rounded.astype("<u2").view(np.uint8)
    raise ValueError(f"special values for type {type_name} are not supported")
