from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: extra intra-op threads only add contention on a shared CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The qwen3moe / qwen3next test modules share these: each module names its ARCH and N_PROMPT, and
# gets the tiny transformers model, its GGUF export, our model, llama.cpp's reference and tokens.


@pytest.fixture(scope="module")
def ref(request: pytest.FixtureRequest) -> dict[str, Any]:
    from tests.core.hybrid_export import load_reference

    return load_reference(request.module.ARCH)


@pytest.fixture(scope="module")
def hf(request: pytest.FixtureRequest) -> Any:
    from tests.core.hybrid_export import hf_model

    return hf_model(request.module.ARCH)


@pytest.fixture(scope="module")
def gguf_path(
    request: pytest.FixtureRequest, hf: Any, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from tests.core.hybrid_export import export

    arch = request.module.ARCH
    return export(hf, arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf")


@pytest.fixture(scope="module")
def lm(gguf_path: Path) -> Any:
    from mgserve.core.models.hybrid import load_hybrid

    return load_hybrid(gguf_path)


@pytest.fixture(scope="module")
def tokens(request: pytest.FixtureRequest, ref: dict[str, Any]) -> torch.Tensor:
    """The prompt, then llama.cpp's greedy continuation (teacher-forced everywhere)."""
    from tests.core.hybrid_export import prompt_tokens

    n = request.module.N_PROMPT
    toks = torch.tensor(ref["tokens"])
    assert torch.equal(toks[:n], prompt_tokens(n))
    return toks


@pytest.fixture(scope="module")
def hf_ref(request: pytest.FixtureRequest, hf: Any, tokens: torch.Tensor) -> torch.Tensor:
    """HF logits: the prompt in one call, then one token per call through HF's cache."""
    from tests.core.hybrid_export import hf_logits

    return hf_logits(hf, tokens, request.module.N_PROMPT)


def require_chunk_invariance(model: Any) -> None:
    """Skip a test of bitwise equality across prompt chunkings on a model whose attention is the
    reference's batched one (``ops.attention``; the hybrid models' tests pass anyway) where this
    CPU's BLAS rounds a query's row by its place in the chunk (ops.chunk_invariant says)."""
    from mgserve.core.reference import ops

    if getattr(model, "rewindable", True) and not ops.chunk_invariant():
        pytest.skip(
            "this CPU's BLAS rounds a row by its place in a batched product: the "
            "reference attention is not bitwise chunk-invariant here (ops.chunk_invariant)"
        )
