"""The torch backend's K/V pools beside reference caches, shared by the CPU tests of the KV,
attention and QSA families (test_kv_torch.py, test_attention_torch.py, test_qsa_torch.py).

A ``World`` holds 3 slots of K/V pools written through ``kv_write`` (tokens of all sessions mixed
in each call, in shuffled order) and, per slot, a reference ``KVCache`` given the same K/V in one
``write``; the ops are then compared with the reference on the dequantized cache.
"""

from __future__ import annotations

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.models.kvcache import KVCache
from mgserve.cuda.backend import torch_backend
from mgserve.cuda.pools import kv_layer

N_SLOTS = 3
RTOL = 1e-5


def spec_for(n_kv: int, d: int) -> ModelSpec:
    return ModelSpec(
        arch="llama",
        name="t",
        n_layer=1,
        n_embd=64,
        n_ff=64,
        n_head=n_kv,
        n_head_kv=n_kv,
        head_dim=d,
        n_vocab=10,
        n_ctx_train=1024,
        rms_eps=1e-5,
        rope_base=1e4,
        rope_base_swa=1e4,
    )


class World:
    """Pools of ``N_SLOTS`` slots with ``lengths[s]`` positions written, and reference caches."""

    def __init__(
        self, cache_type: str, n_ctx: int, n_kv: int, d: int, lengths: list[int], seed: int = 0
    ) -> None:
        self.ops = torch_backend()
        self.n_ctx, self.n_kv, self.d, self.lengths = n_ctx, n_kv, d, lengths
        cpu = torch.device("cpu")
        self.k = kv_layer(cache_type, N_SLOTS, n_ctx, n_kv, d, cpu)
        self.v = kv_layer(cache_type, N_SLOTS, n_ctx, n_kv, d, cpu)
        self.ref = [KVCache(spec_for(n_kv, d), n_ctx, cache_type, cache_type) for _ in lengths]
        g = torch.Generator().manual_seed(seed)
        ks = [torch.randn(n, n_kv, d, generator=g) * 2 for n in lengths]
        vs = [torch.randn(n, n_kv, d, generator=g) for n in lengths]
        for s, n in enumerate(lengths):
            if n:
                ks[s][0, 0, :32] = 0.0  # an all-zero q8_0 block
                self.ref[s].write(0, 0, ks[s], vs[s])
        pairs = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
        order = torch.randperm(len(pairs), generator=g).tolist()
        for c in range(0, len(order), 7):  # batches of 7 tokens from mixed sessions
            batch = [pairs[i] for i in order[c : c + 7]]
            slots = torch.tensor([s for s, _ in batch], dtype=torch.int32)
            pos = torch.tensor([p for _, p in batch], dtype=torch.int32)
            self.ops.kv.write(self.k, torch.stack([ks[s][p] for s, p in batch]), slots, pos)
            self.ops.kv.write(self.v, torch.stack([vs[s][p] for s, p in batch]), slots, pos)

    def keys(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ref[slot].read(0, end)


def close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= rtol * max(scale, 1e-6), f"{name}: max error {err:.3e} vs max |ref| {scale:.3e}"


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
