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
def ops(compiler):
    from mgserve.cuda.ops import CudaOps

    return CudaOps(compiler)


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
