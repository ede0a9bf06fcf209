"""The torch act family (``ActTorch``) against the reference activations on the CPU (runs in CI)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mgserve.cuda.backend import Backend, torch_backend
from tests.cuda.test_deltanet_torch import close, gen


@pytest.fixture(scope="module")
def so() -> Backend:
    return torch_backend()


def test_activations(so: Backend) -> None:
    g = gen(4)
    gate, up = torch.randn(3, 100, generator=g) * 4, torch.randn(3, 100, generator=g)
    close("silu_mul", so.act.silu_mul(gate, up), F.silu(gate) * up, atol=0)
    close("gelu_mul", so.act.gelu_mul(gate, up), F.gelu(gate, approximate="tanh") * up, atol=0)
    with pytest.raises(ValueError, match="differ in shape"):
        so.act.silu_mul(gate, up[:, :99])
