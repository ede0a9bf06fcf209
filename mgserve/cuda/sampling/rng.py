"""The device sampler's random numbers: a pure function of (seed, counter, token id).

``SeqSampler`` keeps a ``torch.Generator`` per session, whose state a batched, graph-captured step
cannot carry. Here a splitmix64 hash on int64 tensors gives each candidate token of a draw a
uniform number, so a session's token depends only on its logits, its parameters, its seed and how
many tokens it has sampled so far: never on the other sessions of the batch, on B, or on which
candidate set size the batch needed. The same seed gives the same tokens as another run of this
sampler, not the same tokens as ``SeqSampler`` (another random stream, the same distribution).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.engine.sampling import new_seed

_U64 = 1 << 64


def to_int64(c: int) -> int:
    """A Python int taken mod 2^64 and read as a signed int64 (torch has no uint64 arithmetic)."""
    c %= _U64
    return c - _U64 if c >= 1 << 63 else c


GOLDEN = to_int64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)
_MIX1 = to_int64(0xBF58476D1CE4E5B9)
_MIX2 = to_int64(0x94D049BB133111EB)


def seeded(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: its own, or a fresh one drawn as ``SeqSampler`` draws it. The
    runner calls this once per session, so the session's whole stream of draws follows from the
    returned params."""
    return params if params.seed is not None else replace(params, seed=new_seed())


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s`` (torch's >> on signed ints is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on an int64 tensor (mod 2^64 arithmetic, read as signed).

    Relies on int64 add/mul wrapping around, which torch's CPU and CUDA kernels do."""
    z = z + GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def splitmix64_int(z: int) -> int:
    """The same function on a Python int (the tests' oracle); returns an unsigned 64-bit value."""
    z = (z + 0x9E3779B97F4A7C15) % _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    return z ^ (z >> 31)


def row_keys(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """int64 [B]: one key per (seed, counter), the start of that draw's splitmix64 stream."""
    return splitmix64(splitmix64(seed) ^ counter)


def uniforms(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 [B, K] in (0, 1): the uniform number of token ``ids`` [B, K] (or [1, K]) in the
    stream of ``key`` [B]. Output ``i`` of the stream is ``splitmix64(key + i * GOLDEN)`` (exactly
    the splitmix64 generator), of which the top 52 bits make ``(m + 0.5) / 2^52``: never 0 or 1,
    so the Gumbel noise -log(-log(u)) is always finite."""
    h = splitmix64(key[:, None] + ids * GOLDEN)  # [B, K]
    m = _srl(h, 12).double()  # [B, K] 52-bit integers, exact in float64
    return (m + 0.5) * (2.0**-52)
