"""The CUDA norm family (``NormCuda``: rms_norm_f32) against the torch one on the same GPU
tensors; the kernels sum in another order, so they agree to ~1e-6 relative."""

from __future__ import annotations

import pytest

from tests.cuda.test_deltanet import close, rand

pytestmark = pytest.mark.gpu


# -- norms ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("d", [2560, 256, 640, 130, 7])
def test_rms_norm(cuda_ops, torch_ops, n: int, d: int) -> None:
    x = rand(n, d, seed=1, scale=3.0)
    w = rand(d, seed=2)
    close("rms_norm", cuda_ops.norm.rms(x, w, 1e-6), torch_ops.norm.rms(x, w, 1e-6), 1e-5, 1e-5)


@pytest.mark.parametrize("d", [2560, 640, 6])
def test_rms_norm_group_weights(cuda_ops, torch_ops, d: int) -> None:
    x = rand(5, 4, d, seed=3)  # [N, G, D]
    w = rand(4, d, seed=4)
    close(
        "rms_norm [G, D]", cuda_ops.norm.rms(x, w, 1e-5), torch_ops.norm.rms(x, w, 1e-5), 1e-5, 1e-5
    )


def test_rms_norm_strided_rows(cuda_ops, torch_ops) -> None:
    """A column slice of a wider activation (row stride != D) is read in place."""
    full = rand(9, 3 * 256, seed=5)
    x = full[:, 256:512]
    w = rand(256, seed=6)
    close(
        "rms_norm view", cuda_ops.norm.rms(x, w, 1e-6), torch_ops.norm.rms(x, w, 1e-6), 1e-5, 1e-5
    )


@pytest.mark.parametrize("n", [1, 8, 33])
@pytest.mark.parametrize(("hv", "dv"), [(48, 128), (3, 8), (2, 6)])
@pytest.mark.parametrize("sigmoid", [False, True])
def test_gated_norm(cuda_ops, torch_ops, n: int, hv: int, dv: int, sigmoid: bool) -> None:
    o = rand(n, hv, dv, seed=7)
    z = rand(n, hv * dv, seed=8, scale=3.0)
    w = rand(dv, seed=9)
    got = cuda_ops.norm.gated(o, z, w, 1e-6, sigmoid)
    close("gated_norm", got, torch_ops.norm.gated(o, z, w, 1e-6, sigmoid), 1e-5, 1e-5)
