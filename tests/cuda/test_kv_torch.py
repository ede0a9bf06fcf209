"""The torch KV ops (``KVTorch``) against the reference cache on the CPU (runs in CI): the pool's
bits equal the reference cache's (q8_0 rounding included, ``kvcache.quantize_q8_0`` being the one
quantizer) and kv_read equals its read. Also the input checks of the ops on pools: kv write / read
shapes and scales, attention's head groups and prefill span."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.models import kvcache
from mgserve.cuda.backend import torch_backend
from mgserve.cuda.pools import KVLayer, kv_layer
from tests.cuda.kv_world import World, rand


def test_kv_write_quantizes_with_the_reference_quantizer() -> None:
    """q8_0 pools hold exactly what ``kvcache.quantize_q8_0`` makes (one quantizer for both)."""
    x = rand(64, 4, 128, seed=1) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 0, :32] = 0.0
    x[1, 0, :32] = torch.arange(32) * 0.5  # many exact halves after scaling
    pool = kv_layer("q8_0", 1, 64, 4, 128, torch.device("cpu"))
    pos = torch.arange(64, dtype=torch.int32)
    torch_backend().kv.write(pool, x, torch.zeros(64, dtype=torch.int32), pos)
    rq, rd = kvcache.quantize_q8_0(x)
    assert torch.equal(pool.values[0], rq)
    assert torch.equal(pool.scales[0].view(torch.int16), rd.view(torch.int16))


@pytest.mark.parametrize("cache_type", ["q8_0", "f16", "f32", "bf16"])
def test_kv_write_matches_reference_cache(cache_type: str) -> None:
    w = World(cache_type, 40, 2, 64, [13, 0, 40], seed=2)
    for s, n in enumerate(w.lengths):
        ref = w.ref[s]
        assert torch.equal(w.k.values[s, :n], ref.k.values[0, :n]), f"slot {s} K values"
        assert torch.equal(w.v.values[s, :n], ref.v.values[0, :n]), f"slot {s} V values"
        if cache_type == "q8_0":
            assert torch.equal(w.k.scales[s, :n], ref.k.scales[0, :n]), f"slot {s} K scales"
        assert not w.k.values[s, n:].float().abs().any(), f"slot {s}: unwritten rows touched"
        if n == 0:  # (the reference cache cannot read 0 rows of q8_0)
            assert w.ops.kv.read(w.k, s, 0).shape == (0, w.n_kv, w.d)
            continue
        rk, rv = w.keys(s, n)
        assert torch.equal(w.ops.kv.read(w.k, s, n), rk)
        assert torch.equal(w.ops.kv.read(w.v, s, n), rv)


def test_checks_reject_bad_shapes() -> None:
    w = World("q8_0", 16, 2, 32, [4, 4, 4])
    with pytest.raises(ValueError, match="x has shape"):
        w.ops.kv.write(
            w.k,
            torch.zeros(2, 3, 32),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="slots"):
        w.ops.kv.write(
            w.k,
            torch.zeros(2, 2, 32),
            torch.zeros(3, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="not a multiple"):
        w.ops.attention.decode(
            torch.zeros(1, 3, 32),
            w.k,
            w.v,
            torch.zeros(1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            scale=1.0,
        )
    with pytest.raises(ValueError, match="do not fit"):
        w.ops.attention.prefill(torch.zeros(4, 4, 32), w.k, w.v, 0, 14, scale=1.0)
    bad = KVLayer(w.k.values, w.k.scales[..., :0])
    with pytest.raises(ValueError, match="scales"):
        w.ops.kv.read(bad, 0, 4)
