"""The ple family on the CUDA backend (the linear family's kernels and the norm kernel) against the
torch backend on the same GPU tensors: decode-sized batches (matvec kernels, ~1e-6) and a prompt
chunk (f16 GEMMs, ~1e-3)."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.test_ple_torch import DIL, HC, HIST, D, inputs, weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("n", "tol"), [(3, 1e-5), (40, 5e-3)])
def test_gate_matches_torch(cuda_ops, torch_ops, n: int, tol: float) -> None:
    args, _ = weights(4, "cuda")
    x, emb = (t.cuda() for t in inputs(n, 4))
    got = cuda_ops.ple.gated(x, emb, *args)
    want = torch_ops.ple.gated(x, emb, *args)
    for name, a, b in zip(("gated", "conv input"), got, want, strict=True):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= tol, f"{name} N={n}: relative error {err:.2e}"


def test_conv_decode_matches_torch(cuda_ops, torch_ops) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    conv = torch.randn(HC * D, 3, generator=g, device="cuda")
    hist = torch.randn(4, HIST, HC * D, generator=g, device="cuda")
    x = torch.randn(2, HC * D, generator=g, device="cuda")
    slots = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    h1, h2 = hist.clone(), hist.clone()
    a = cuda_ops.ple.conv_decode(x, h1, slots, conv, DIL)
    b = torch_ops.ple.conv_decode(x, h2, slots, conv, DIL)
    assert torch.equal(a, b) and torch.equal(h1, h2)
