"""GPU fixtures for the CUDA op tests. cuda.core is imported inside the fixtures, so collecting
these tests on a machine without cuda-python (CI) never fails;
the ``gpu`` marker skips them there."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mgserve-cache")


@pytest.fixture(scope="session")
def compiler(kernel_cache: Path):
    pytest.importorskip("cuda.core")
    from mgserve.cuda.compiler import KernelCompiler

    return KernelCompiler(0, cache_dir=kernel_cache)


@pytest.fixture(scope="session")
def kernels(compiler):
    from mgserve.cuda.launch import Kernels

    return Kernels(compiler)


@pytest.fixture(scope="session")
def cuda_ops(kernels):
    """The CUDA backend on the test's kernel cache."""
    from mgserve.cuda.backend import cuda_backend

    return cuda_backend(kernels=kernels)


@pytest.fixture
def torch_ops():
    """The torch backend (the GPU tests' oracle on the same device's tensors); one per test, as
    its dense-weight cache is keyed by storage address, which a later test's weights may reuse."""
    from mgserve.cuda.backend import torch_backend

    return torch_backend()


@pytest.fixture(scope="session")
def cuda_ops_int8(kernels):
    """The CUDA backend with int8-rounded activations in the matvecs that have an int8 kernel."""
    from mgserve.cuda.backend import cuda_backend

    return cuda_backend(kernels=kernels, int8=True)


@pytest.fixture(scope="session")
def ops(cuda_ops):
    """The CUDA linear family (matvec, int8 activations, dequantization)."""
    return cuda_ops.linear


@pytest.fixture(scope="session")
def spin(kernels):
    """spin(stream, ns): keep a cuda.core stream busy for ns of GPU time (util.cu)."""
    import numpy as np

    def run(stream, nanoseconds: int) -> None:
        kernels.launch(
            kernels.kernel("util.cu", "spin_ns"), 1, 1, np.uint64(nanoseconds), stream=stream
        )

    return run


@pytest.fixture(scope="session")
def stream(compiler):
    from mgserve.cuda import runtime

    return runtime.new_stream(compiler.device_index)


@pytest.fixture
def stable_qsa_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's QSA breaks score ties like the device path (earlier block first) instead
    of torch.topk's unspecified order, so device and reference select the same blocks."""
    import functools

    from mgserve.core.reference import qsa

    monkeypatch.setattr(qsa, "select", functools.partial(qsa.select, stable=True))
