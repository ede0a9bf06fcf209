"""The CUDA act family (``ActCuda``: act.cu) against the torch one on the same GPU tensors."""

from __future__ import annotations

import pytest

from tests.cuda.test_deltanet import close, rand

pytestmark = pytest.mark.gpu


# -- activations ------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "f"), [(1, 9728), (8, 9728), (300, 1024), (3, 77)])
def test_activations(cuda_ops, torch_ops, n: int, f: int) -> None:
    gate, up = rand(n, f, seed=15, scale=4.0), rand(n, f, seed=16)
    close("silu_mul", cuda_ops.act.silu_mul(gate, up), torch_ops.act.silu_mul(gate, up), 1e-5, 1e-5)
    close("gelu_mul", cuda_ops.act.gelu_mul(gate, up), torch_ops.act.gelu_mul(gate, up), 1e-5, 1e-5)


def test_activations_fused_halves(cuda_ops, torch_ops) -> None:
    """gate and up as the two column halves of one [N, 2F] projection."""
    gu = rand(4, 2 * 512, seed=17, scale=3.0)
    gate, up = gu[:, :512], gu[:, 512:]
    close(
        "silu_mul halves",
        cuda_ops.act.silu_mul(gate, up),
        torch_ops.act.silu_mul(gate, up),
        1e-5,
        1e-5,
    )
