"""The CUDA KV op (``KVCuda.write``) against the torch one (``KVTorch``, which
tests/cuda/test_kv_torch.py checks against the reference) on the same GPU pools: kv_write must be
bit-identical (q8_0 rounding included), and positions outside the pool are skipped."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.models import kvcache
from mgserve.cuda.pools import kv_layer
from tests.cuda.attention_inputs import DEV, gen, i32, randn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["q8_0", "f16", "f32"])
def test_kv_write_is_bit_identical(cuda_ops, torch_ops, kind: str) -> None:
    n_slots, n_ctx, n_kv, d, n = 3, 50, 2, 256, 40
    x = randn(n, n_kv, d, seed=1) * torch.logspace(-3, 3, n, device=DEV)[:, None, None]
    x[0, 0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, 1, :32] = torch.arange(32, device=DEV) * 0.5  # exact halves after scaling
    perm = torch.randperm(n_slots * n_ctx, generator=gen(2), device=DEV)[:n]
    slots, pos = (perm // n_ctx).to(torch.int32), (perm % n_ctx).to(torch.int32)
    got = kv_layer(kind, n_slots, n_ctx, n_kv, d, torch.device(DEV))
    want = kv_layer(kind, n_slots, n_ctx, n_kv, d, torch.device(DEV))
    cuda_ops.kv.write(got, x, slots, pos)
    torch_ops.kv.write(want, x, slots, pos)
    torch.cuda.synchronize()
    bad = (got.values != want.values).sum().item()
    assert bad == 0, f"{kind}: {bad} values differ from the torch write"
    if kind == "q8_0":
        assert torch.equal(got.scales.view(torch.int16), want.scales.view(torch.int16))
        q, sc = kvcache.quantize_q8_0(x.cpu())  # the CPU reference rounding itself
        assert torch.equal(got.values[slots.long(), pos.long()].cpu(), q)
        assert torch.equal(
            got.scales[slots.long(), pos.long()].cpu().view(torch.int16), sc.view(torch.int16)
        )
    before = got.values.clone()
    cuda_ops.kv.write(got, x[:2], i32([0, 1]), i32([n_ctx, -1]))  # outside the pool: skipped
    torch.cuda.synchronize()
    assert torch.equal(got.values, before), "out-of-range positions must not be written"
