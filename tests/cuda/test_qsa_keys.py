"""QSA block keys on the CUDA backend (norm and rope kernels) against the torch backend on the same
GPU tensors, decode (graph-shaped, all slots at once) and a prompt chunk."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.test_qsa_keys_torch import DIM, EPS, ROT, pools

pytestmark = pytest.mark.gpu


def test_keys_match_torch(cuda_ops, torch_ops) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    raw = torch.randn(31, DIM, generator=g, device="cuda")  # row t + 1 of the last step too
    k_norm = torch.rand(DIM, generator=g, device="cuda") + 0.5
    got, want = [t.cuda() for t in pools(3)], [t.cuda() for t in pools(3)]
    for b, (pending, blocks) in ((cuda_ops, got), (torch_ops, want)):
        b.qsa_keys.write_span(raw[:21], pending, blocks, 2, 0, k_norm, EPS, **ROT)
        slots = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
        for t in range(21, 30):
            pos = torch.tensor([t, t - 21], dtype=torch.int32, device="cuda")
            b.qsa_keys.write_decode(raw[t : t + 2], pending, blocks, slots, pos, k_norm, EPS, **ROT)
    for name, a, b in zip(("pending", "blocks"), got, want, strict=True):
        err = (a - b).abs().max().item()
        assert err <= 1e-5, f"{name}: max error {err:.2e}"
