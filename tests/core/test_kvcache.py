from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mgserve.config import CACHE_TYPES
from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.models.kvcache import (
    KVCache,
    dequantize_q8_0,
    kv_bytes_per_token,
    kv_storage,
    quantize_q8_0,
)

SPEC = ModelSpec(
    arch="llama", name="t", n_layer=3, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, head_dim=32,
    n_vocab=100, n_ctx_train=128, rms_eps=1e-5, rope_base=1e4, rope_base_swa=1e4,
)  # fmt: skip


def test_q8_0_round_trip_matches_ggml() -> None:
    x = torch.randn(5, 2, 64) * 3
    x[0, 0, :32] = 0.0  # an all-zero block must stay zero
    q, d = quantize_q8_0(x)
    got = dequantize_q8_0(q, d).numpy()
    raw = gguf.quants.quantize(x.numpy().reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
    np.testing.assert_array_equal(got, ref)
    assert (got[0, 0, :32] == 0).all()


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_write_read_and_size(kind: str) -> None:
    cache = KVCache(SPEC, 16, kind, kind)
    k, v = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    cache.write(1, 3, k, v)
    rk, rv = cache.read(1, 7)
    assert rk.shape == (7, 2, 32) and rk.dtype == torch.float32
    tol = {"f32": 0.0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 2e-2}[kind]
    assert (rk[3:] - k).abs().max() <= tol * k.abs().max()
    assert (rv[3:] - v).abs().max() <= tol * v.abs().max()
    assert rk[:3].abs().max() == 0  # untouched positions
    assert cache.read(0, 7)[0].abs().max() == 0  # other layers untouched
    assert cache.nbytes == 16 * kv_bytes_per_token(SPEC, kind, kind)


@pytest.mark.parametrize("kind", CACHE_TYPES)
def test_kv_storage_is_one_table_for_every_cache_type(kind: str) -> None:
    """The reference cache and the device pools (cuda/pools.py) both allocate through it."""
    values, scales = kv_storage(kind, (2, 5, 3, 64))
    if kind == "q8_0":
        assert values.dtype == torch.int8 and scales.shape == (2, 5, 3, 2)
        assert scales.dtype == torch.float16
    else:
        dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
        assert values.dtype == dtypes[kind]
        assert scales.numel() == 0
    assert values.shape == (2, 5, 3, 64) and values.abs().max() == 0


def test_kv_storage_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="cache type"):
        kv_storage("q4_0", (1, 64))
    with pytest.raises(ValueError, match="divisible by 32"):
        kv_storage("q8_0", (1, 48))


def test_kv_bytes_per_token() -> None:
    # 3 layers x 64 values (2 heads x 32) for K and for V
    assert kv_bytes_per_token(SPEC, "f16", "f16") == 3 * 64 * 4
    assert kv_bytes_per_token(SPEC, "f32", "q8_0") == 3 * (64 * 4 + 64 * 34 // 32)
    with pytest.raises(ValueError, match="cache type"):
        kv_bytes_per_token(SPEC, "q4_0", "f16")


def test_out_of_range_positions() -> None:
    cache = KVCache(SPEC, 8)
    with pytest.raises(ValueError, match="do not fit"):
        cache.write(0, 6, torch.zeros(3, 2, 32), torch.zeros(3, 2, 32))
    with pytest.raises(ValueError, match="do not fit"):
        cache.read(0, 9)
    with pytest.raises(ValueError, match="n_ctx"):
        KVCache(SPEC, 0)
