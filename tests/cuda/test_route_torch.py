"""The torch MoE routing (``RouteTorch.top_k``) against the reference ``moe.route`` on the CPU
(runs in CI): bit-identical experts and weights given the reference's own router logits, with
and without renormalisation, at qwen4exp's shape (256 experts, top 10) and small ones."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.reference import moe, ops
from mgserve.cuda.ops.route import RouteTorch


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("n", "n_embd", "n_expert", "k"),
    [(1, 64, 8, 2), (7, 32, 64, 8), (33, 128, 256, 10), (5, 16, 512, 16), (3, 16, 4, 4)],
)
@pytest.mark.parametrize("norm", [True, False])
def test_route_is_bit_identical_to_reference(
    n: int, n_embd: int, n_expert: int, k: int, norm: bool
) -> None:
    x, router = rand(n, n_embd, seed=1), rand(n_expert, n_embd, seed=2) * 0.3
    want = moe.route(x, router, k, norm)
    got = RouteTorch().top_k(ops.linear(x, router), k, norm)
    assert got.experts.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert got.experts.shape == (n, k) and got.weights.shape == (n, k)
    assert torch.equal(got.experts.long(), want.experts), "experts differ from moe.route"
    assert torch.equal(got.weights, want.weights), (
        f"weights differ from moe.route by {(got.weights - want.weights).abs().max():.3e}"
    )
    if norm:
        sums = got.weights.sum(dim=1)
        assert torch.allclose(sums, torch.ones(n), atol=1e-6), f"weight sums {sums.tolist()}"


def test_route_unnormalised_weights_are_probabilities() -> None:
    logits = rand(4, 40, seed=3)
    got = RouteTorch().top_k(logits, 5, False)
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(got.weights, probs.gather(1, got.experts.long()))
    assert (got.weights[:, :-1] >= got.weights[:, 1:]).all(), "weights must come best first"


def test_route_rejects_bad_arguments() -> None:
    r = RouteTorch()
    with pytest.raises(ValueError, match="float32"):
        r.top_k(torch.zeros(2, 8, dtype=torch.float16), 2, True)
    with pytest.raises(ValueError, match="shape"):
        r.top_k(torch.zeros(8), 2, True)
    with pytest.raises(ValueError, match="k must be"):
        r.top_k(torch.zeros(2, 8), 9, True)
    with pytest.raises(ValueError, match="k must be"):
        r.top_k(torch.zeros(2, 8), 0, True)
