"""Random session state at a given depth, for benchmarks: a slot looks as if it had consumed
``depth`` tokens (K/V, QSA block keys, recurrent and conv states), in a second instead of the
minutes a real 250k-token prefill takes. Attention and QSA cost depends on how many positions are
read, not on their values, so decode and prefill timings at that depth are representative; the
benchmark says when it used this.
"""

from __future__ import annotations

import torch

from mgserve.cuda.models.base import DeviceLM
from mgserve.cuda.pools import KVLayer

_CHUNK = 8192  # positions written per call, to bound temporary memory


def _fill_kv(kv: KVLayer, slot: int, depth: int, gen: torch.Generator) -> None:
    dev = kv.values.device
    for p0 in range(0, depth, _CHUNK):
        p1 = min(depth, p0 + _CHUNK)
        shape = kv.values[slot, p0:p1].shape
        if kv.quantized:
            kv.values[slot, p0:p1] = torch.randint(-127, 128, shape, generator=gen, device=dev,
                                                   dtype=torch.int8)  # fmt: skip
            kv.scales[slot, p0:p1] = 0.01
        else:
            vals = torch.randn(shape, generator=gen, device=dev)
            kv.values[slot, p0:p1] = vals.to(kv.values.dtype)


def fill_synthetic(model: DeviceLM, slot: int, depth: int, seed: int = 0) -> None:
    """Write random state for positions [0, depth) of ``slot`` into every pool of ``model``."""
    pools = model.pools
    if not 0 <= depth <= pools.n_ctx:
        raise ValueError(f"depth {depth} outside the pools' context of {pools.n_ctx}")
    dev = next(iter(pools.k.values())).values.device if pools.k else torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(seed + slot)
    for il in pools.k:
        _fill_kv(pools.k[il], slot, depth, gen)
        _fill_kv(pools.v[il], slot, depth, gen)
    for il, blocks in pools.blocks.items():
        n = depth // pools.pending[il].shape[1]
        blocks[slot, :n] = torch.randn(blocks[slot, :n].shape, generator=gen, device=dev)
    for t in (*pools.conv.values(), *pools.ssm.values()):
        t[slot] = 0.01 * torch.randn(t[slot].shape, generator=gen, device=dev)
