"""The CUDA QSA selection kernel (qsa_select.cu, ``QsaCuda.select_blocks``) against
``select_blocks`` (whose rule tests/cuda/test_qsa_torch.py checks): it must be exactly equal, on
the same scores: random rows, rows full of ties (all +0, all equal, a few distinct values), the
best blocks at the tail, dense queries (complete <= top) and lengths from 1 to 262144 (65536
blocks) in batches of 1..8, and after a CUDA-graph capture + replay; each with one CTA a row
(qsa_select) and on thread block clusters (qsa_select_c, sm_90). ``pytest -s`` prints the
selection's time at 65536 blocks.
"""

from __future__ import annotations

import pytest
import torch

from mgserve.cuda.ops import qsa as qsa_ops
from tests.cuda.attention_inputs import DEV, DI, HI, gen, i32, randn

pytestmark = pytest.mark.gpu

SEL_COLS, SEL_RATIO, SEL_TOP = 65536, 4, 512  # qwen4exp at 262144 tokens


def score_rows(kind: str, n: int, n_cols: int, seed: int) -> torch.Tensor:
    """[n, n_cols] block scores of one kind (see test_qsa_select_kernel)."""
    g = gen(seed)
    if kind == "relu":  # like the indexer: ~40% exact zeros, the rest spread over binades
        x = torch.randn(n, n_cols, generator=g, device=DEV) + 0.3
        return torch.relu(x * torch.randn(n, 1, generator=g, device=DEV).abs() * 3)
    if kind == "zeros":  # every block ties: the first `top` blocks win
        return torch.zeros(n, n_cols, device=DEV)
    if kind == "equal":  # one positive value everywhere (not the +0 fast path)
        return torch.full((n, n_cols), 0.75, device=DEV)
    if kind == "few":  # 4 values, heavy ties at the cut
        return torch.randint(0, 4, (n, n_cols), generator=g, device=DEV).float() * 0.5
    if kind == "ulps":  # neighbouring floats: only the last radix digit separates them
        steps = torch.randint(0, 5, (n, n_cols), generator=g, device=DEV)
        return (torch.tensor(1.0, device=DEV).view(torch.int32) + steps).view(torch.float32)
    if kind == "tail":  # increasing with the block: the last complete blocks win
        return torch.arange(n_cols, device=DEV, dtype=torch.float32).expand(n, -1) * 1e-3
    if kind == "signed":  # negative scores, -0.0 and -inf (not from the indexer, but ordered)
        x = torch.randn(n, n_cols, generator=g, device=DEV)
        x[x.abs() < 0.3] = -0.0
        x[x < -2.0] = float("-inf")
        return x
    raise ValueError(kind)


SEL_KINDS = ["relu", "zeros", "equal", "few", "ulps", "tail", "signed"]
# dense (0, 1, complete = top - 1, top), the first sparse lengths, mid-block, the pool's end
SEL_LENGTHS = [0, 1, 4 * 511 + 3, 2048, 2051, 2052, 2053, 100003, 262143, 262144]


def check_selection(cuda_ops, torch_ops, scores: torch.Tensor, lengths: torch.Tensor, name: str,
                    ratio: int = SEL_RATIO, top: int = SEL_TOP) -> None:  # fmt: skip
    got = cuda_ops.qsa.select_blocks(scores, lengths, ratio=ratio, top=top)
    want = torch_ops.qsa.select_blocks(scores, lengths, ratio=ratio, top=top)
    assert got.shape == want.shape and got.dtype == torch.int32, f"{name}: {got.shape} {got.dtype}"
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        diff = (got[i] != want[i]).nonzero().flatten()[:5].tolist()
        raise AssertionError(
            f"{name}: rows {bad} differ (lengths {[int(lengths[j]) for j in bad]}); row {i} at "
            f"{diff}: got {got[i, diff].tolist()} want {want[i, diff].tolist()}"
        )


@pytest.fixture(params=[False, True], ids=["cta", "cluster"])
def sel_cluster(cuda_ops, request):  # type: ignore[no-untyped-def]
    """QsaCuda.cluster off (one CTA a row) and on (a cluster a row: skipped before sm_90)."""
    if request.param and not cuda_ops.kernels.clusters:
        pytest.skip("thread block clusters need sm_90")
    before = cuda_ops.qsa.cluster
    cuda_ops.qsa.cluster = request.param
    yield request.param
    cuda_ops.qsa.cluster = before


@pytest.mark.parametrize("kind", SEL_KINDS)
def test_qsa_select_kernel(cuda_ops, torch_ops, sel_cluster: bool, kind: str) -> None:
    """Every kind at every length in one batch of 10, each row also alone (the selection must
    not depend on the batch)."""
    scores = score_rows(kind, len(SEL_LENGTHS), SEL_COLS, seed=40)
    lengths = i32(SEL_LENGTHS)
    check_selection(cuda_ops, torch_ops, scores, lengths, f"select {kind}")
    both = cuda_ops.qsa.select_blocks(scores, lengths, ratio=SEL_RATIO, top=SEL_TOP)
    for i in (2, 6, 9):
        alone = cuda_ops.qsa.select_blocks(
            scores[i : i + 1], lengths[i : i + 1], ratio=SEL_RATIO, top=SEL_TOP
        )
        assert torch.equal(alone[0], both[i]), f"{kind}: row {i} depends on the batch"
    dense = both[3]  # 2048 tokens = 512 complete blocks = top: every block
    assert torch.equal(dense.long().cpu(), torch.arange(SEL_TOP)), "dense row must select all"
    assert (both[1] == -1).all() and (both[0] == -1).all(), "rows without blocks: all -1"


@pytest.mark.parametrize("b", [1, 2, 3, 5, 8])
def test_qsa_select_batches(cuda_ops, torch_ops, sel_cluster: bool, b: int) -> None:
    """Random lengths 1..262144 in batches of 1..8; ratio 1 and 4, small and large `top`, row
    lengths that are not a multiple of 4 (the padded copy)."""
    g = torch.Generator().manual_seed(41 + b)
    for ratio, top, n_cols in ((4, 512, 65536), (1, 37, 1001), (4, 8, 50), (2, 3000, 9999)):
        lengths = torch.randint(1, n_cols * ratio + 1, (b,), generator=g).int().to(DEV)
        for kind in ("relu", "few"):
            scores = score_rows(kind, b, n_cols, seed=42 + b)
            check_selection(
                cuda_ops,
                torch_ops,
                scores,
                lengths,
                f"B={b} {kind} ratio {ratio} top {top}",
                ratio,
                top,
            )


def test_qsa_select_capture_and_timing(cuda_ops, torch_ops, sel_cluster: bool) -> None:
    """The selection captures into a CUDA graph and replays on new scores and lengths; then
    (informational, pytest -s) its time per layer at 65536 blocks beside torch.topk + sort."""
    scores = score_rows("relu", 8, SEL_COLS, seed=43)
    lengths = i32([262144, 200001, 150000, 100000, 65536, 30000, 5000, 2100])
    kw = {"ratio": SEL_RATIO, "top": SEL_TOP}
    cuda_ops.qsa.select_blocks(scores, lengths, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel = cuda_ops.qsa.select_blocks(scores, lengths, **kw)
    scores.copy_(score_rows("few", 8, SEL_COLS, seed=44))
    lengths.copy_(i32([2052, 262144, 9, 262000, 70001, 2048, 131072, 4]))
    graph.replay()
    torch.cuda.synchronize()
    check_selection(cuda_ops, torch_ops, scores, lengths, "select replay")
    assert torch.equal(sel, torch_ops.qsa.select_blocks(scores, lengths, **kw)), "replay differs"

    scores.copy_(score_rows("relu", 8, SEL_COLS, seed=45))
    full = i32([SEL_COLS * SEL_RATIO] * 8)
    keys = qsa_ops.rank_keys(scores)
    blocks, iq = randn(8, SEL_COLS, DI, seed=46), randn(8, HI, DI, seed=47)
    slots = i32(list(range(8)))

    def topk_sort(b: int) -> None:
        keys[:b].topk(SEL_TOP, dim=1, sorted=False).indices.sort(dim=1)

    for b in (1, 8):
        for name, fn in (
            (
                "qsa_select",
                lambda b=b: cuda_ops.qsa.select(scores[:b], full[:b], SEL_COLS, 4, SEL_TOP),
            ),
            ("torch topk + sort", lambda b=b: topk_sort(b)),
            (
                "(qsa_scores)",
                lambda b=b: cuda_ops.qsa.scores(
                    iq[:b], blocks, slots[:b], full[:b], SEL_COLS, SEL_RATIO, SEL_TOP
                ),
            ),
        ):
            fn()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(20):
                fn()
            t1.record()
            torch.cuda.synchronize()
            us = t0.elapsed_time(t1) / 20 * 1e3
            how = "clusters" if sel_cluster else "a CTA a row"
            print(f"QSA selection of {SEL_TOP} of {SEL_COLS} blocks, B={b}, {name} ({how}): "
                  f"{us:.1f} us")  # fmt: skip
