"""The MoE routing kernel (``RouteCuda.route``, kernels/route.cu) against the torch version and a
stable-sort oracle on the GPU.

The kernel's softmax rounds differently from torch's (~1 ulp), so weights are compared to 1e-6
and experts exactly where the logits leave no near-tie (spaced logits); on ties (equal logits,
hence bit-equal probabilities in both) the kernel must give the lower expert id first, which the
oracle (a stable descending sort of torch's probabilities) does too. Shapes: qwen4exp (256
experts, top 10) at 1..4096 tokens, and 8..512 experts with k = 1..32; a CUDA-graph capture; and
(pytest -s) the time of one decode step's routing beside the torch ops it replaces.
"""

from __future__ import annotations

import pytest
import torch

from mgserve.core.reference.moe import MIN_WEIGHT_SUM

pytestmark = pytest.mark.gpu

DEV = "cuda"
ATOL = 1e-6  # weights are <= 1


@pytest.fixture(scope="module")
def rt(cuda_ops):
    return cuda_ops.route


@pytest.fixture(scope="module")
def ref():
    from mgserve.cuda.ops.route import RouteTorch

    return RouteTorch()


def spaced_logits(n: int, e: int, seed: int) -> torch.Tensor:
    """Each row a permutation of 0, 0.02, 0.04, ..: probabilities 2% apart, no near-ties."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    perm = torch.argsort(torch.rand(n, e, generator=g, device=DEV), dim=1)
    return perm.float() * 0.02 - 3.0


def oracle(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's probabilities, a stable descending sort (ties: lower expert first)."""
    probs = torch.softmax(logits, dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    w = probs.gather(1, order)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    return order.to(torch.int32), w


def check(name: str, got, experts: torch.Tensor, weights: torch.Tensor) -> None:
    assert got.experts.dtype == torch.int32 and got.experts.shape == experts.shape, name
    bad = (got.experts != experts).any(dim=1).nonzero().flatten().tolist()
    assert not bad, (
        f"{name}: experts differ in rows {bad[:8]}; row {bad[0]}: "
        f"{got.experts[bad[0]].tolist()} != {experts[bad[0]].tolist()}"
    )
    err = (got.weights - weights).abs().max().item() if weights.numel() else 0.0
    assert err <= ATOL, f"{name}: weights differ by {err:.2e} (shape {list(weights.shape)})"
    print(f"{name}: max weight error {err:.1e}")


@pytest.mark.parametrize(
    ("n", "e", "k"),
    [(1, 256, 10), (8, 256, 10), (4096, 256, 10), (5, 8, 1), (3, 8, 8), (7, 64, 8),
     (9, 512, 16), (2, 512, 32), (6, 100, 7), (33, 33, 32)],
)  # fmt: skip
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_torch(rt, ref, n: int, e: int, k: int, norm: bool) -> None:
    logits = spaced_logits(n, e, seed=n * 1000 + e + k)
    want = ref.top_k(logits, k, norm)
    check(f"route N={n} E={e} k={k} norm={norm}", rt.top_k(logits, k, norm), *want)
    if n > 1:  # each token alone: no dependence on the batch
        alone = rt.top_k(logits[n - 1 :], k, norm)
        full = rt.top_k(logits, k, norm)
        assert torch.equal(alone.weights[0], full.weights[-1]), "a token depends on the batch"


@pytest.mark.parametrize("kind", ["equal", "few", "masked"])
def test_route_ties_go_to_the_lower_expert(rt, kind: str) -> None:
    g = torch.Generator(device=DEV).manual_seed(7)
    n, e, k = 64, 256, 10
    if kind == "equal":  # every expert ties
        logits = torch.full((n, e), 0.5, device=DEV)
    elif kind == "few":  # 4 distinct values: ties inside the top k and at its edge
        logits = torch.randint(0, 4, (n, e), generator=g, device=DEV).float()
    else:  # -inf logits (probability 0) fill the top k past the few finite ones
        logits = torch.full((n, e), float("-inf"), device=DEV)
        logits[:, 200:205] = torch.randn(n, 5, generator=g, device=DEV)
    for norm in (True, False):
        check(f"ties {kind} norm={norm}", rt.top_k(logits, k, norm), *oracle(logits, k, norm))


def test_route_random_logits(rt, ref) -> None:
    """Normal logits at qwen4exp's shape: weights agree everywhere; experts wherever torch's
    probabilities leave a clear gap around each chosen rank."""
    g = torch.Generator(device=DEV).manual_seed(8)
    logits = torch.randn(4096, 256, generator=g, device=DEV) * 2
    got, want = rt.top_k(logits, 10, True), ref.top_k(logits, 10, True)
    err = (got.weights - want.weights).abs().max().item()
    assert err <= ATOL, f"random logits: weights differ by {err:.2e}"
    top = torch.softmax(logits, -1).topk(11, dim=-1).values
    clear = ((top[:, :-1] - top[:, 1:]) > 1e-5 * top[:, :1]).all(dim=1)
    same = (got.experts == want.experts).all(dim=1)
    assert same[clear].all(), f"{int((~same[clear]).sum())} clear rows choose other experts"
    assert clear.float().mean() > 0.9, "the test's gap rule leaves too few rows"


def test_route_capture_and_timing(rt, ref) -> None:
    """The routing captures into a CUDA graph; then (pytest -s) one decode step's routing."""
    logits = spaced_logits(8, 256, seed=9)
    rt.top_k(logits, 10, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rt.top_k(logits, 10, True)
    logits.copy_(spaced_logits(8, 256, seed=10))
    graph.replay()
    torch.cuda.synchronize()
    check("route replay", out, *ref.top_k(logits, 10, True))

    for name, fn in (("kernel", rt.top_k), ("torch", ref.top_k)):
        for b in (1, 8, 4096):
            x = spaced_logits(b, 256, seed=11)
            fn(x, 10, True)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(20):
                fn(x, 10, True)
            t1.record()
            torch.cuda.synchronize()
            print(f"route N={b} E=256 k=10 {name}: {t0.elapsed_time(t1) / 20 * 1e3:.1f} us")
