"""The torch norm family (``NormTorch``) against ``reference.ops.rms_norm`` on the CPU (runs in CI;
the gated norm is checked with the DeltaNet output in test_deltanet_torch.py)."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.reference import ops
from mgserve.cuda.backend import Backend, torch_backend
from tests.cuda.test_deltanet_torch import close, gen


@pytest.fixture(scope="module")
def so() -> Backend:
    return torch_backend()


@pytest.mark.parametrize("shape", [(3, 2560), (5, 256), (2, 640), (4, 7)])
def test_rms_norm(so: Backend, shape: tuple[int, int]) -> None:
    g = gen(0)
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    close("rms_norm", so.norm.rms(x, w, 1e-6), ops.rms_norm(x, w, 1e-6), atol=0)


def test_rms_norm_group_weights(so: Backend) -> None:
    g = gen(1)
    x = torch.randn(3, 4, 640, generator=g)  # [N, G, D]: hyper-connection streams
    w = torch.randn(4, 640, generator=g)
    y = so.norm.rms(x, w, 1e-5)
    for i in range(4):
        close(f"stream {i}", y[:, i], ops.rms_norm(x[:, i], w[i], 1e-5), atol=0)


def test_rms_norm_bad_weight(so: Backend) -> None:
    with pytest.raises(ValueError, match="does not match"):
        so.norm.rms(torch.zeros(3, 4, 8), torch.zeros(3, 8), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        so.norm.rms(torch.zeros(3, 8, dtype=torch.float64), torch.zeros(8), 1e-6)
