"""The transformers version that the hybrid exporter tests were written against, checked once.

tests/core/hybrid_export.py (qwen3moe, qwen3next) and tests/core/qwen4exp_export.py build tiny
random transformers models and write them as llama.cpp's converter does; they read config fields
and module internals that change between transformers releases (on another release qwen4exp's
``layer_types`` has no "indexed_attention" and the export fails). Every test that builds one of
these models asks ``pinned_transformers()`` first, so on another release it is skipped with the
reason instead of failing inside an exporter. The device tests can still run there on GGUF files
exported elsewhere (MGSERVE_TEST_TINY, see tests/cuda/test_device_models.py).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from packaging.version import Version

PINNED = (5, 23)  # transformers 5.23.x


def pinned_transformers() -> ModuleType:
    """The transformers module; skips the calling test when it is missing or not 5.23.x."""
    tf = pytest.importorskip("transformers")
    if Version(tf.__version__).release[:2] != PINNED:
        pinned = ".".join(map(str, PINNED))
        pytest.skip(
            f"the hybrid exporters are written against transformers {pinned}.x; "
            f"{tf.__version__} is installed"
        )
    return tf
