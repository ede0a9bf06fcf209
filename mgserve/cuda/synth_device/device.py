"""``synth_weight``: a large matrix of a synthetic model made directly on the device, by tiling
a per-type pool of random blocks (made once per device and type)."""

from __future__ import annotations

from math import prod

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from mgserve.core.gguf.reader import TensorInfo
from mgserve.cuda.synth_device.blocks import block_bytes, make_blocks, supported_types
from mgserve.cuda.weights import QuantWeight, row_bytes

# per-type pool synth_weight tiles; "meta": the memory plan's trace of a CUDA load (plan_trace.py)
DEVICE_POOL_BYTES = {"cuda": 64 << 20, "meta": 64 << 20, "cpu": 4 << 20}
_POOL_SEED = 0x5EED

_device_pools: dict[tuple[str, str], torch.Tensor] = {}


def _device_pool(type_name: str, device: torch.device) -> torch.Tensor:
    """The cached flat uint8 pool of ``type_name`` blocks on ``device``."""
    key = (str(device), type_name)
    pool = _device_pools.get(key)
    if pool is None:
        unit = block_bytes(type_name)
        n_blocks = max(1, DEVICE_POOL_BYTES.get(device.type, DEVICE_POOL_BYTES["cpu"]) // unit)
        seed = _POOL_SEED + int(GGMLQuantizationType[type_name])
        # the meta device has no generator (and no values to draw)
        gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
        pool = _device_pools[key] = make_blocks(type_name, n_blocks, device, gen).view(-1)
    return pool


def release_pools(device_type: str | None = None) -> None:
    """Drop the cached per-type device pools (a few hundred MB of GPU memory after a load), of
    ``device_type`` (``"meta"``: the plan's traces) only when given."""
    for key in list(_device_pools):
        if device_type is None or key[0].split(":")[0] == device_type:
            del _device_pools[key]


def synth_weight(t: TensorInfo, device: torch.device | str, seed: int = 0) -> QuantWeight:
    """``t`` as a QuantWeight of valid random blocks made on ``device``, without host data.

    The bytes are a per-type random pool (made once per device and type) tiled from a
    block-aligned start that ``seed`` picks, so tensors differ and a 35 GB model takes a few
    device-to-device copies of bandwidth, not 35 GB of fresh randomness. ValueError if the CUDA
    kernels cannot read ``t``'s type or row width, or no generator exists for the type.
    """
    if not t.shape:
        raise ValueError(f"tensor {t.name!r} has no dimensions")
    rb = row_bytes(t.name, t.type_name, t.shape[0])  # validates the type and width
    rows = prod(t.shape[1:])
    total = rows * rb
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if t.type_name not in supported_types():
        raise ValueError(f"tensor {t.name!r}: no synthetic data generator for {t.type_name}")
    pool = _device_pool(t.type_name, dev)  # [P * unit]
    unit = block_bytes(t.type_name)
    n_units = pool.numel() // unit
    pos = int(np.random.default_rng(seed).integers(0, n_units)) * unit
    out = torch.empty(total, dtype=torch.uint8, device=dev)  # [rows * row_bytes]
    done = 0
    while done < total:
        n = min(total - done, pool.numel() - pos)
        out[done : done + n].copy_(pool[pos : pos + n])
        done += n
        pos = 0
    return QuantWeight(t.name, t.type_name, tuple(t.shape), out.view(rows, rb))


def device_made(name: str, type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``synth_weight`` can make this tensor (a type and row width the CUDA kernels read);
    other tensors keep host data whatever their size."""
    if type_name not in supported_types():
        return False
    try:
        row_bytes(name, type_name, shape[0])
    except ValueError:
        return False
    return True
