"""QSA block keys (``BlockKeys`` on the torch backend) against ``mgserve.core.reference.qsa`` on the
CPU (runs in CI): pooled keys equal ``qsa.pool_blocks`` (to the rope angles' rounding), and a
session's blocks come out the same whether its tokens arrive one per decode step, in one prompt
chunk, or in chunks that end mid-block."""

from __future__ import annotations

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.reference import qsa
from mgserve.cuda.backend import torch_backend

R, DIM, N_CTX, EPS = 4, 64, 48, 1e-6
ROT = {"n_rot": 32, "base": 1e4, "scale": 1.0}


def spec() -> ModelSpec:
    return ModelSpec(
        arch="qwen4exp", name="t", n_layer=1, n_embd=64, n_ff=64, n_head=1, n_head_kv=1,
        head_dim=DIM, n_vocab=10, n_ctx_train=N_CTX, rms_eps=EPS, rope_base=1e4,
        rope_base_swa=1e4, n_rot=32,
    )  # fmt: skip


def pools(n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pending [n_slots, R, DIM], blocks [n_slots, N_CTX / R, DIM]."""
    return torch.zeros(n_slots, R, DIM), torch.zeros(n_slots, N_CTX // R, DIM)


def test_pool_is_reference() -> None:
    g = torch.Generator().manual_seed(1)
    raw, k_norm = torch.randn(5, R, DIM, generator=g), torch.rand(DIM, generator=g) + 0.5
    got = torch_backend().qsa_keys.pool(raw, torch.arange(2, 7) * R, k_norm, EPS, **ROT)
    w = qsa.IndexerWeights(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(DIM), k_norm)
    want = qsa.pool_blocks(raw, 2, w, spec())
    assert (got - want).abs().max().item() <= 2e-6


def test_decode_prefill_and_splits_agree() -> None:
    b = torch_backend()
    g = torch.Generator().manual_seed(2)
    raw, k_norm = torch.randn(30, DIM, generator=g), torch.rand(DIM, generator=g) + 0.5
    whole = pools(2)
    b.qsa_keys.write_span(raw, *whole, 1, 0, k_norm, EPS, **ROT)
    split = pools(2)
    for a, z in ((0, 3), (3, 10), (10, 30)):  # chunks ending mid-block
        b.qsa_keys.write_span(raw[a:z], *split, 1, a, k_norm, EPS, **ROT)
    dec = pools(2)
    for t in range(30):
        one = torch.tensor([1], dtype=torch.int32)
        b.qsa_keys.write_decode(raw[t : t + 1], *dec, one, torch.tensor([t]), k_norm, EPS, **ROT)
    n_blk = 30 // R
    for name, (_, blocks) in (("split", split), ("decode", dec)):
        err = (blocks[1, :n_blk] - whole[1][1, :n_blk]).abs().max().item()
        assert err <= 2e-6, f"{name}: blocks differ by {err:.2e}"
    assert torch.equal(split[0][1, : 30 % R], raw[n_blk * R :]), "pending keys of the tail"
    assert not whole[1][0].any() and not dec[1][0].any(), "slot 0 written"
