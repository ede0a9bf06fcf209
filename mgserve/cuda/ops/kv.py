"""The KV family: writing K/V rows into the slot pools (``KVLayer``) and reading them back.

q8_0 pools hold int8 values and one f16 scale per 32 values, rounded by the reference cache's
own quantizer (``kvcache.quantize_q8_0``), so a pool's bits equal the reference cache's. Index
tensors (slots, positions) are int32 (or int64) of one entry per row written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mgserve.core.models.kvcache import Q8_0_BLOCK, quantize_q8_0
from mgserve.cuda.checks import as_i32, check_f32, check_index, on_device, shape_error
from mgserve.cuda.launch import Kernels
from mgserve.cuda.pools import KVLayer

UTIL_SOURCE = "attention_util.cu"
KV_WRITE_MAX_DIM = 1024  # one thread per value of a head
_KV_DTYPES = (torch.int8, torch.float16, torch.float32, torch.bfloat16)


def check_layer(name: str, c: KVLayer) -> None:
    vals = c.values
    if vals.dim() != 4:
        raise shape_error(f"{name}.values", vals, "[n_slots, n_ctx, n_kv, head_dim]")
    if vals.dtype not in _KV_DTYPES:
        raise ValueError(f"{name}.values must be one of {_KV_DTYPES}, got {vals.dtype}")
    if c.quantized:
        if vals.shape[3] % Q8_0_BLOCK:
            raise ValueError(
                f"{name}: q8_0 needs head_dim divisible by {Q8_0_BLOCK}, got {vals.shape[3]}"
            )
        want = (*vals.shape[:3], vals.shape[3] // Q8_0_BLOCK)
        if c.scales.dtype != torch.float16 or tuple(c.scales.shape) != want:
            raise ValueError(
                f"{name}.scales must be float16 {list(want)}, got {c.scales.dtype} "
                f"{list(c.scales.shape)}"
            )


def check_kv(k: KVLayer, v: KVLayer) -> tuple[int, int, int, int]:
    """(n_slots, n_ctx, n_kv, head_dim) of a K/V pair of pools."""
    check_layer("k", k)
    check_layer("v", v)
    if k.values.shape != v.values.shape:
        raise ValueError(
            f"k pool {list(k.values.shape)} and v pool {list(v.values.shape)} differ in shape"
        )
    n_slots, n_ctx, n_kv, d = k.values.shape
    return n_slots, n_ctx, n_kv, d


def check_span(n_ctx: int, n_slots: int, slot: int, start: int, t: int) -> None:
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot {slot} outside the pool's {n_slots} slots")
    if start < 0 or start + t > n_ctx:
        raise ValueError(f"positions {start}..{start + t - 1} do not fit {n_ctx} positions")


def dequant(c: KVLayer, *index: Any) -> torch.Tensor:
    """float32 ``c.values[index]`` (the same leading index applied to the q8_0 scales)."""
    vals = c.values[index]
    if not c.quantized:
        return vals.float()
    scales = c.scales[index].float()
    return (vals.float().unflatten(-1, (-1, Q8_0_BLOCK)) * scales[..., None]).flatten(-2)


def _check_write(cache: KVLayer, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> None:
    check_layer("cache", cache)
    check_f32("x", x)
    if x.dim() != 3 or tuple(x.shape[1:]) != tuple(cache.values.shape[2:]):
        raise shape_error("x", x, f"[N, {cache.values.shape[2]}, {cache.values.shape[3]}]")
    check_index("slots", slots, x.shape[0])
    check_index("pos", pos, x.shape[0])


class KVTorch:
    """Pool writes and reads in plain PyTorch (static shapes: index_put_)."""

    def write(
        self,
        cache: KVLayer,
        x: torch.Tensor,  # [N, n_kv, D] float32
        slots: torch.Tensor,  # [N] int32
        pos: torch.Tensor,  # [N] int32
    ) -> None:
        """Write token i's ``x[i]`` at (slots[i], pos[i]) of ``cache`` (q8_0: rounded exactly as
        the reference cache rounds)."""
        _check_write(cache, x, slots, pos)
        index = (slots.long(), pos.long())
        if cache.quantized:
            q, d = quantize_q8_0(x)
            cache.values.index_put_(index, q)
            cache.scales.index_put_(index, d)
        else:
            cache.values.index_put_(index, x.to(cache.values.dtype))

    def read(self, cache: KVLayer, slot: int, end: int) -> torch.Tensor:
        """float32 [end, n_kv, D]: positions 0..end-1 of ``slot``, dequantized."""
        check_layer("cache", cache)
        n_slots, n_ctx = cache.values.shape[:2]
        check_span(n_ctx, n_slots, slot, 0, end)
        return dequant(cache, slot, slice(0, end))


class KVCuda:
    """Pool writes with the kv_write kernel (f32, f16 and q8_0 pools; bf16 pools and heads over
    KV_WRITE_MAX_DIM values go to the torch version). Rows outside the pool are skipped."""

    def __init__(self, kernels: Kernels, fallback: KVTorch) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device
        self.read = fallback.read  # reads are torch indexing on any device

    def write(
        self, cache: KVLayer, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor
    ) -> None:
        kinds = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
        kind = kinds.get(cache.values.dtype)
        d = cache.values.shape[-1] if cache.values.dim() == 4 else 0
        if kind is None or d > KV_WRITE_MAX_DIM or not on_device(self.device, cache.values, x):
            self.fallback.write(cache, x, slots, pos)
            return
        _check_write(cache, x, slots, pos)
        n_ctx, n_kv = cache.values.shape[1], cache.values.shape[2]
        if not cache.values.is_contiguous() or (
            cache.quantized and not cache.scales.is_contiguous()
        ):
            raise ValueError("cache pools must be contiguous")
        if x.shape[0] == 0:
            return
        x = x.contiguous()
        self.kernels.launch(
            self.kernels.kernel(UTIL_SOURCE, "kv_write"),
            (x.shape[0], n_kv),
            d,
            x.data_ptr(),
            cache.values.data_ptr(),
            cache.scales.data_ptr() if cache.quantized else 0,
            as_i32("slots", slots, self.device).data_ptr(),
            as_i32("pos", pos, self.device).data_ptr(),
            np.int32(n_ctx),
            np.int32(n_kv),
            np.int32(kind),
        )
