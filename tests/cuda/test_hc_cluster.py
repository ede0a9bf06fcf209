"""The decode mix on thread block clusters (``HCCuda.cluster``: kernels/hc.cu's hc_downc and
hc_upl, cuda/ops/hc_cluster.py) against the float64 reference as test_hc.py holds the unclustered
kernels to it: qwen4exp's shape in the formats a file has, 1..16 tokens, odd shapes (hc not 4, a
cluster of one piece per stream, a 64 KB slice opted in; hc 9, which keeps the unclustered
kernels), the head's mix; then batch invariance (every token group), the fused combine and graph
replay bitwise, and the pieces' choice itself. Each GPU test checks that the clusters ran."""

from __future__ import annotations

import pytest
import torch

from mgserve.cuda.ops.hc import HCTuning
from mgserve.cuda.ops.hc_cluster import CLUSTER_MAX, cluster_pieces, static_smem
from tests.cuda.test_hc import (
    ODD,
    REAL,
    REAL_N,
    assert_replays_match_eager,
    check_mix,
    fused_mix,
    hc_cuda,
)
from tests.cuda.test_hc_torch import EPS, make_case, make_streams


def test_pieces_fill_the_cluster_and_fit() -> None:
    """qwen4exp: 2 slices of 1280 per stream (8 CTAs); hc 5: one each; no pieces past 8
    streams, where no slice is a whole number of 8-value runs, or where 8 tokens' slice does
    not stage in CLUSTER_SMEM; the static shared memory the kernel declares."""
    assert cluster_pieces(4, 2560) == 2
    assert cluster_pieces(5, 72) == 1
    assert cluster_pieces(2, 272) == 2  # 4 pieces: 68 values, not whole runs
    assert cluster_pieces(9, 64) is None
    assert cluster_pieces(1, 12) is None
    assert cluster_pieces(4, 4096) == 2  # 8 tokens of 2048 values: 64 KB, opted in
    assert cluster_pieces(8, 8192) is None  # one piece: 8 tokens of 8192 values, 256 KB
    assert cluster_pieces(4, 4096, smem=48 * 1024) is None  # 2 pieces' 64 KB over the limit
    # qwen4exp's slice and the static arrays fit without opting in (test_kernels_offline.py
    # holds static_smem to what ptxas reports)
    assert 8 * 1280 * 4 + static_smem(HCTuning(), 8) <= 48 * 1024
    for hc, d in ((1, 64), (2, 2048), (3, 96), (4, 2560), (8, 512)):
        p = cluster_pieces(hc, d)
        assert p is not None and hc * p <= CLUSTER_MAX and (d // p) % 8 == 0, (hc, d, p)


@pytest.fixture(scope="module")
def hcc(kernels):
    if not kernels.clusters:
        pytest.skip("no thread block clusters before sm_90")
    ops = hc_cuda(kernels)
    ops.cluster = True
    return ops


@pytest.fixture
def clustered(hcc, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Counts the clustered mixes a GPU test runs; one that runs none fails (unless its shapes
    keep the unclustered kernels: ``UNCLUSTERED``)."""
    import mgserve.cuda.ops.hc_cuda as hc_cuda_module

    calls: list[int] = []
    real = hc_cuda_module.mix_clustered

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hc_cuda_module, "mix_clustered", spy)
    yield calls
    if request.node.name not in UNCLUSTERED:
        assert calls, f"{request.node.name}: no mix ran on clusters"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "types",
    [
        "BF16", "Q8_0", ("Q8_0", "BF16", "F32"),
        ("Q4_K", "Q5_0", "Q4_K"),  # llama-quantize Q4_K_M
        ("Q4_K", "Q5_0", "Q6_K"),  # down and inject differ: two cluster launches, one aside
        ("Q6_K", "Q8_0", "Q6_K"),
    ],
)  # fmt: skip
def test_mix_real_shape(hcc, clustered, types: str | tuple[str, str, str]) -> None:
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=1, device="cuda")
    errors = [
        check_mix(hcc, case, make_streams(n, hc, d, seed=n), f"{types} N={n}") for n in REAL_N
    ]
    print(f"hc_mix cluster {types}: errors {[(f'{a:.1e}', f'{b:.1e}') for a, b in errors]}")


HC9 = (3, 9, 64, 16, "F32")  # 9 streams: more than a cluster holds
UNCLUSTERED = {f"test_mix_odd_shapes[shape{len(ODD)}]"}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*ODD, HC9])
def test_mix_odd_shapes(hcc, clustered, shape: tuple) -> None:
    n, hc, d, r, types = shape
    assert (cluster_pieces(hc, d) is None) == (shape == HC9)
    case = make_case(hc, d, r, types, seed=n + d, device="cuda")
    check_mix(hcc, case, make_streams(n, hc, d, seed=d), f"cluster {shape}")


@pytest.mark.gpu
def test_head_mix(hcc, clustered) -> None:
    hc, d, r = REAL
    case = make_case(hc, d, r, ("Q8_0", "F16", "Q8_0"), seed=2, head=True, device="cuda")
    for n in (1, 5):
        check_mix(hcc, case, make_streams(n, hc, d, seed=n), f"cluster head N={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("types", ["BF16", ("Q4_K", "Q5_0", "Q4_K"), ("Q4_K", "Q5_0", "Q6_K")])
def test_batch_invariant(hcc, clustered, types: str | tuple[str, str, str]) -> None:
    """Tokens 0 and 9 alone and in batches of 2, 3, 8, 13, 16 (token groups of 2, 4 and 8):
    the same bits."""
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=5, device="cuda")
    x = make_streams(16, hc, d, seed=5).cuda()
    alone = {t: fused_mix(hcc, case, x[t : t + 1]) for t in (0, 9)}
    for n in (2, 3, 8, 13, 16):
        mixed, inj = fused_mix(hcc, case, x[:n])
        for t, (m1, i1) in alone.items():
            if t < n:
                assert torch.equal(mixed[t], m1[0]), f"{types}: token {t} in {n}"
                assert inj is not None and i1 is not None and torch.equal(inj[t], i1[0])


@pytest.mark.gpu
@pytest.mark.parametrize("types", ["BF16", ("Q4_K", "Q5_0", "Q6_K")])
def test_combine_mix_is_combine_then_mix(hcc, clustered, types: str | tuple[str, str, str]) -> None:
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=4, device="cuda")
    g = torch.Generator().manual_seed(4)
    for n in (1, 4, 11):  # 11 in a decode step: the kernels, as two token groups
        x = make_streams(n, hc, d, seed=n).cuda()
        out = torch.randn(n, d, generator=g).cuda()
        inj_prev = (torch.rand(n, hc, generator=g) * 2).cuda()
        with hcc.linear.path.step("decode"):
            x_new, mixed, inj = hcc.combine_mix(
                x, out, inj_prev, case.norm, case.down, case.up, case.inject, EPS
            )
            want_x = hcc.combine(x, out, inj_prev)
            want_mixed, want_inj = hcc.mix(want_x, case.norm, case.down, case.up, case.inject, EPS)
        assert torch.equal(x_new, want_x), f"{types} N={n}: fused new x"
        assert torch.equal(mixed, want_mixed), f"{types} N={n}: fused mixed"
        assert inj is not None and want_inj is not None and torch.equal(inj, want_inj)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8])
def test_graph_capture(hcc, clustered, n: int) -> None:
    """combine_mix captured once, replayed with new streams: bitwise the eager op."""
    hc, d, r = REAL
    case = make_case(hc, d, r, ("Q4_K", "Q5_0", "Q6_K"), seed=6, device="cuda")
    g = torch.Generator().manual_seed(6)
    inputs = [
        (make_streams(n, hc, d, seed=10 + i), torch.randn(n, d, generator=g),
         torch.rand(n, hc, generator=g) * 2)
        for i in range(2)
    ]  # fmt: skip

    def step(x: torch.Tensor, out: torch.Tensor, ip: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_new, mixed, inj = hcc.combine_mix(
            x, out, ip, case.norm, case.down, case.up, case.inject, EPS
        )
        assert inj is not None
        return x_new, mixed, inj

    assert_replays_match_eager(step, inputs, f"cluster N={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("types", ["BF16", ("Q4_K", "Q5_0", "Q4_K"), ("Q6_K", "Q8_0", "Q6_K")])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_mix_writes_xq(kernels, types: str | tuple[str, str, str], n: int) -> None:
    """int8 decode rows: the clustered mix also writes its output rounded to int8 (``emit_xq``,
    off by default; hc_upl on 32-column CTAs). The output is bitwise the 16-column CTAs'
    (``emit_xq`` off), its int8 form bitwise ``quantize_q8``'s of it, and ``linear.quantize``
    hands that form out while the output is unchanged (a write ends it)."""
    if not kernels.clusters:
        pytest.skip("no thread block clusters before sm_90")
    ops = hc_cuda(kernels)
    ops.cluster, ops.linear.int8 = True, True
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=n, device="cuda")
    x = make_streams(n, hc, d, seed=n + 7).cuda()
    with ops.linear.path.step("decode"):
        ops.emit_xq = False
        want, want_inj = fused_mix(ops, case, x)
        assert ops.linear.q8.offered(want) is None
        ops.emit_xq = True
        got, got_inj = fused_mix(ops, case, x)
        assert torch.equal(got, want), f"{types} N={n}: mixed differs on 32-column CTAs"
        assert got_inj is not None and want_inj is not None and torch.equal(got_inj, want_inj)
        offered = ops.linear.q8.offered(got)
        assert offered is not None, f"{types} N={n}: no int8 form written"
        fresh = ops.linear.q8.quantize(got)
        assert torch.equal(offered.q, fresh.q) and torch.equal(offered.d, fresh.d), f"{types}"
        assert ops.linear.quantize(got) is offered
        got.add_(0.0)  # a write (even of the same values): the form is no longer handed out
        assert ops.linear.q8.offered(got) is None


@pytest.mark.gpu
@pytest.mark.parametrize("xq", [False, True], ids=["f32", "xq"])
@pytest.mark.parametrize("types", ["BF16", ("Q4_K", "Q5_0", "Q4_K"), ("Q4_K", "Q5_0", "Q6_K")])
def test_stage_hoist_is_the_same_bits(hcc, clustered, types: str | tuple, xq: bool) -> None:
    """``stage_hoist`` (hc_downc loads 4 tokens' stream values together, hc_upl 8 strides of
    low, not each inside its own branch): the same new x, mixed and inject, bitwise, with and
    without the fused combine, at every token count 1..8, and 11 and 16 (groups cut short);
    ``xq``: int8 rows, whose mixes with an inject also write the int8 form (hc_uplq)."""
    before = hcc.stage_hoist, hcc.linear.int8, hcc.emit_xq
    hcc.linear.int8 = hcc.emit_xq = xq
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=12, device="cuda")
    g = torch.Generator().manual_seed(12)
    try:
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16):
            x = make_streams(n, hc, d, seed=n + 20).cuda()
            out = torch.randn(n, d, generator=g).cuda()
            inj_prev = (torch.rand(n, hc, generator=g) * 2).cuda()
            got = []
            for hoist in (False, True):
                hcc.stage_hoist = hoist
                with hcc.linear.path.step("decode"):
                    fused = hcc.combine_mix(
                        x, out, inj_prev, case.norm, case.down, case.up, case.inject, EPS
                    )
                    mix = hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS)
                    got.append((*fused, *mix))
            names = ("new x", "mixed", "inject", "mix", "mix inject")
            for name, a, b in zip(names, *got, strict=True):
                what = f"{types} int8={xq} N={n}: {name}"
                assert a is not None and b is not None and torch.equal(a, b), what
    finally:
        hcc.stage_hoist, hcc.linear.int8, hcc.emit_xq = before
