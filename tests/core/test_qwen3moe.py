"""qwen3moe on the reference path against transformers 5.23 (float32) and llama.cpp (saved JSON).

The tiny model (tests/core/hybrid_export.py): hidden 128, 4 layers, 4 query / 2 KV heads of 32,
8 experts top-2 (renormalised, as llama.cpp always does), random weights. Errors are measured as
max |diff| / max |logit| (``rel_error``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.gguf.reader import GGUFError
from mgserve.core.models.base import SeqInput
from mgserve.core.models.kvcache import KVCache
from mgserve.core.reference import moe
from tests.core.hybrid_export import (
    file_sha256,
    rel_error,
    run_chunks,
)

ARCH = "qwen3moe"
N_PROMPT = 100
TOL = 1e-4  # float32 reference vs float32 transformers: observed ~2e-6


pytestmark = pytest.mark.usefixtures("one_thread")


def new_cache(lm: Any) -> KVCache:
    return lm.new_cache(256, "f32", "f32")


@pytest.mark.parametrize("chunk", [N_PROMPT, 64, 7])
def test_prefill_and_decode_match_transformers(
    lm: Any, tokens: torch.Tensor, hf_ref: torch.Tensor, chunk: int
) -> None:
    cache = new_cache(lm)
    got = torch.cat(
        [
            run_chunks(lm, cache, tokens[:N_PROMPT], chunk),
            run_chunks(lm, cache, tokens[N_PROMPT:], 1, start=N_PROMPT),  # decode steps
        ]
    )
    assert rel_error(got[:N_PROMPT], hf_ref[:N_PROMPT]) <= TOL
    assert rel_error(got[N_PROMPT:], hf_ref[N_PROMPT:]) <= TOL


def test_routing_matches_transformers(hf: Any, lm: Any) -> None:
    """Same experts, same (renormalised) weights as HF's router on random inputs."""
    x = torch.randn(64, lm.spec.n_embd, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, want_w, want_e = hf.model.layers[1].mlp.gate(x)
    got = moe.route(x, lm.layers[1].moe.router, lm.hybrid.n_expert_used, lm.hybrid.norm_topk)
    assert torch.equal(got.experts, want_e)
    torch.testing.assert_close(got.weights, want_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.weights.sum(dim=1), torch.ones(64))


def test_sessions_batched_equal_alone(lm: Any, tokens: torch.Tensor) -> None:
    starts = (50, 30, 7, 61, 12, 40, 0)
    sizes = (1, 1, 1, 1, 1, 9, 20)
    caches = [new_cache(lm) for _ in starts]
    for n, cache in zip(starts, caches, strict=True):
        if n:
            run_chunks(lm, cache, tokens[:n], 64)
    seqs = [
        SeqInput(cache, tokens[n : n + t], n, min(t, 2))
        for cache, n, t in zip(caches, starts, sizes, strict=True)
    ]
    together = lm.forward(seqs)
    alone = torch.cat([lm.forward([s]) for s in seqs])  # rewrites the same K/V rows
    assert torch.equal(together, alone)  # concurrency never changes results (DESIGN.md)


def test_missing_expert_key_is_a_clear_error(gguf_path: Path) -> None:
    from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf
    from mgserve.core.gguf.reader import GGUFFile

    g = GGUFFile(gguf_path)
    del g.metadata["qwen3moe.expert_count"]
    with pytest.raises(GGUFError, match="qwen3moe.expert_count"):
        hybrid_spec_from_gguf(g)


def test_matches_llama_cpp(lm: Any, gguf_path: Path, ref: dict[str, Any], tokens: torch.Tensor):
    """llama.cpp (F32 weights, F32 KV) differs only by float rounding order: |diff| ~1e-5 on
    logits of scale ~5. We allow 1e-3 and require the same top-1 token at every position and
    the same top-5 logits."""
    assert file_sha256(gguf_path) == ref["gguf_sha256"], (
        "the exported file changed: rerun tests/data/make_hybrid_reference.py"
    )
    cache = new_cache(lm)
    got = torch.cat(
        [
            run_chunks(lm, cache, tokens[:N_PROMPT], N_PROMPT),
            run_chunks(lm, cache, tokens[N_PROMPT:], 1, start=N_PROMPT),
        ]
    )
    top5 = torch.tensor(ref["top5"])
    assert torch.equal(got.argmax(dim=1), top5[:, 0])
    torch.testing.assert_close(
        torch.gather(got, 1, top5), torch.tensor(ref["top5_logits"]), rtol=0, atol=1e-3
    )
    torch.testing.assert_close(
        got[N_PROMPT - 1], torch.tensor(ref["last_prompt_logits"]), rtol=0, atol=1e-3
    )
    torch.testing.assert_close(got[-1], torch.tensor(ref["last_logits"]), rtol=0, atol=1e-3)
