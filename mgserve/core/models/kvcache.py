"""Per-slot KV cache of the reference path: K and V for every layer and ``n_ctx`` positions.

Cache types emulate llama.cpp's: ``f32``, ``f16``, ``bf16`` store rounded elements; ``q8_0`` stores
blocks of 32 values along head_dim as int8 plus one f16 scale (34 bytes per 32 values), quantized on
write and dequantized on read exactly as ggml's ``quantize_row_q8_0_ref`` / ``dequantize_row_q8_0``.
Every layer keeps all ``n_ctx`` positions, sliding-window layers included (simple, not frugal).
"""

from __future__ import annotations

import torch

from mgserve.config import CACHE_TYPES
from mgserve.core.gguf.hparams import ModelSpec

Q8_0_BLOCK = 32  # q8_0: values per block along head_dim, sharing one f16 scale
_FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": (Q8_0_BLOCK + 2) / Q8_0_BLOCK}


def _check_type(cache_type: str) -> None:
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"cache type must be one of {CACHE_TYPES}, got {cache_type!r}")


def kv_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes one position costs across all layers, K and V together."""
    _check_type(type_k)
    _check_type(type_v)
    per_layer = spec.kv_dim * (_BYTES_PER_VALUE[type_k] + _BYTES_PER_VALUE[type_v])
    return int(round(spec.n_layer * per_layer))


def kv_storage(
    cache_type: str, shape: tuple[int, ...], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (values, scales) holding K or V of ``shape`` [..., head_dim] in ``cache_type``: q8_0
    as int8 values and f16 scales [..., head_dim / Q8_0_BLOCK], a float type as values of its
    dtype and no scales. The reference cache and the device pools both store this way."""
    _check_type(cache_type)
    if cache_type != "q8_0":
        values = torch.zeros(shape, dtype=_FLOAT_DTYPES[cache_type], device=device)
        return values, torch.zeros(0, dtype=torch.float16, device=device)
    head_dim = shape[-1]
    if head_dim % Q8_0_BLOCK:
        raise ValueError(f"q8_0 cache needs head_dim divisible by {Q8_0_BLOCK}, got {head_dim}")
    values = torch.zeros(shape, dtype=torch.int8, device=device)
    scales = torch.zeros((*shape[:-1], head_dim // Q8_0_BLOCK), dtype=torch.float16, device=device)
    return values, scales


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float32 -> (int8 [..., D], f16 scales [..., D / 32]), on any device (the device
    backend's KV writes use it too). The divisor 127 is a tensor: CUDA torch turns a division by
    a Python scalar into a multiply by its reciprocal (an ulp off ggml); the CPU divides either
    way, so the bits are ggml's on both."""
    blocks = x.reshape(*x.shape[:-1], -1, Q8_0_BLOCK)  # [..., D/32, 32]
    amax = blocks.abs().amax(dim=-1)
    d = amax / amax.new_full((1,), 127.0)  # [..., D/32] float32, as ggml computes it
    inv = torch.where(d > 0, torch.ones_like(d) / d, torch.zeros_like(d))
    scaled = blocks * inv[..., None]
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: half away from zero
    return q.to(torch.int8).reshape(x.shape), d.to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    blocks = q.reshape(*q.shape[:-1], -1, Q8_0_BLOCK).to(torch.float32)
    return (blocks * d.to(torch.float32)[..., None]).reshape(q.shape)


class _Store:
    """One of K or V: [n_layer, n_ctx, n_head_kv, head_dim] values of one cache type."""

    def __init__(self, cache_type: str, n_layer: int, n_ctx: int, n_kv: int, head_dim: int):
        self.type = cache_type
        self.values, self.scales = kv_storage(cache_type, (n_layer, n_ctx, n_kv, head_dim))

    def write(self, layer: int, start: int, x: torch.Tensor) -> None:
        end = start + x.shape[0]
        if self.type == "q8_0":
            q, d = quantize_q8_0(x)
            self.values[layer, start:end] = q
            self.scales[layer, start:end] = d
        else:
            self.values[layer, start:end] = x.to(self.values.dtype)

    def read(self, layer: int, end: int) -> torch.Tensor:  # [end, n_kv, head_dim] float32
        if self.type == "q8_0":
            return dequantize_q8_0(self.values[layer, :end], self.scales[layer, :end])
        return self.values[layer, :end].to(torch.float32)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


class KVCache:
    """The K/V state of one slot. Positions [0, n_ctx) can be written; anything past is an error."""

    def __init__(self, spec: ModelSpec, n_ctx: int, type_k: str = "f16", type_v: str = "f16"):
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        self.n_ctx = n_ctx
        dims = (spec.n_layer, n_ctx, spec.n_head_kv, spec.head_dim)
        self.k = _Store(type_k, *dims)
        self.v = _Store(type_v, *dims)

    def _check(self, start: int, n: int) -> None:
        if start < 0 or start + n > self.n_ctx:
            raise ValueError(
                f"positions {start}..{start + n - 1} do not fit a cache of {self.n_ctx} positions"
            )

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, n_kv, head_dim] at positions start..start+T-1 of ``layer``."""
        self._check(start, k.shape[0])
        self.k.write(layer, start, k)
        self.v.write(layer, start, v)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [end, n_kv, head_dim] float32 of positions 0..end-1, rounded by the cache type."""
        self._check(0, end)
        return self.k.read(layer, end), self.v.read(layer, end)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
