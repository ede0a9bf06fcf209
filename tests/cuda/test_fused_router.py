"""The fused MoE decode launches against the separate ones they replace, bitwise on the GPU:

- ``RouteCuda.router`` (route.cu's matvec_route_<T>_t<NT>): the router's product, the routing and
  the shared expert's gate in one launch, against ``linear.matmul`` then ``route.top_k``, and
  against the gate ``moe.add_shared`` computes (add_shared(0, 1, h, gate) is that gate exactly);
  every router format and token bucket, expert counts that fill the last CTA or not, repeated
  launches (the last CTA resets its counter) and a CUDA-graph replay, with the launch's tokens
  in one group or in groups of 2 and 1 (route.split), and one token's loads in batches
  (route.batch, route.unroll);
- ``MoeCuda.experts(shared=...)``: the shared expert added by the down kernel against
  ``experts`` then ``add_shared``, fp32 and int8, gated or not, with and without a residual.

Whole decode steps with both (``fused_decode``) against the separate launches:
test_fused_decode.py.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from mgserve.cuda.ops.linear_tuning import token_bucket
from tests.cuda.test_deltanet import rand
from tests.cuda.test_moe_torch import make_weight

pytestmark = pytest.mark.gpu

N_TOKENS = (1, 3, 5, 8)
SHAPES = [(256, 10, 2560), (512, 10, 2048), (64, 8, 256), (100, 7, 96)]  # (experts, k, d)


def gate_of(ops, h: torch.Tensor, gate_inp: torch.Tensor) -> torch.Tensor:
    """The shared expert's gates [N] as ``moe.add_shared`` computes them."""
    zeros, ones = torch.zeros_like(h), torch.ones_like(h)
    return ops.moe.add_shared(zeros, ones, h, gate_inp)[:, 0].contiguous()


@pytest.fixture(
    params=[
        (False, False, 0, 0),
        (True, False, 0, 0),
        (False, True, 0, 0),
        (True, True, 0, 0),
        (True, True, 2, 0),
        (True, True, 1, 0),
        (False, True, 2, 0),
        (True, True, 1, 10),
        (True, True, 1, 3),
        (True, True, 0, 3),
    ],
    ids=[
        "plain",
        "lean",
        "plain_acq_rel",
        "acq_rel",
        "split2",
        "split1",
        "plain_split2",
        "batch10",
        "batch3",
        "batch3_groups",
    ],  # fmt: skip
)
def lean(cuda_ops, request):  # type: ignore[no-untyped-def]
    """route.lean off and on (a row a warp, the top k by warp reductions), each with the tickets
    taken by fences and by one acq_rel atomic a CTA (route.tickets.acq_rel, the default), the
    tokens in groups of 2 and of 1 (route.split: grid y, a counter and a last CTA a group), and
    route.batch with 10 runs a batch (a 2560-wide row's in one) and 3 (rows of several batches,
    the last one partial; a launch's tokens in one group too, where only its 1-token kernel
    batches): the same results. (Yields route.lean.)"""
    rt, tickets = cuda_ops.route, cuda_ops.route.tickets
    before = rt.lean, tickets.acq_rel, rt.split, rt.split_tokens, rt.batch, rt.unroll
    rt.lean, tickets.acq_rel, group, unroll = request.param
    rt.split, rt.split_tokens = group > 0, group or rt.split_tokens
    rt.batch, rt.unroll = unroll > 0, unroll or rt.unroll
    yield request.param[0]
    rt.lean, tickets.acq_rel, rt.split, rt.split_tokens, rt.batch, rt.unroll = before


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize(("e", "k", "d"), SHAPES)
def test_router_is_matvec_then_top_k(cuda_ops, lean: bool, type_name: str, n: int, e: int,
                                     k: int, d: int, monkeypatch) -> None:  # fmt: skip
    rng = np.random.default_rng(e * 100 + n)
    w, _ = make_weight(type_name, e, d, rng, "cuda")
    h, gate_inp = rand(n, d, seed=n), rand(d, seed=n + 50)
    rt = cuda_ops.route
    assert rt.fuses(n, w, k)
    grids: list[tuple[int, int]] = []  # each launch's grid (the router's: y, its token groups)
    real, real_kernel = rt.kernels.launch, rt.kernels.kernel
    monkeypatch.setattr(rt.kernels, "launch", lambda kern, grid, *a, **kw: (
        grids.append(grid), real(kern, grid, *a, **kw)))  # fmt: skip
    asked: list[dict[str, str]] = []  # the router kernels' -D defines (the settings reach them)
    monkeypatch.setattr(rt.kernels, "kernel", lambda src, name, defines=(), *a, **kw: (
        asked.append(dict(defines)) if src == "route.cu" else None,
        real_kernel(src, name, defines, *a, **kw))[1])  # fmt: skip
    group = token_bucket(min(n, rt.split_tokens) if rt.split else n)  # tokens a group
    want_gate = gate_of(cuda_ops, h, gate_inp)
    for norm in (True, False):
        want = rt.top_k(cuda_ops.linear.matmul(h, w), k, norm)
        for gate in (gate_inp, None, gate_inp):  # twice: each launch leaves its counter at 0
            grids.clear()
            got = rt.router(h, w, k, norm, gate)
            what = f"{type_name} N={n} E={e} k={k} norm={norm}"
            assert [g[1] for g in grids] == [-(-n // group)], f"{what}: {grids}"
            assert asked[-1].get("RUN_BATCH") == ("1" if rt.lean and rt.batch else None), what
            if rt.lean:
                assert asked[-1]["RUN_UNROLL"] == str(rt.unroll), what
            assert int(rt.tickets.buf.count_nonzero()) == 0, f"{what}: a counter left set"
            assert torch.equal(got.route.experts, want.experts), what
            assert torch.equal(got.route.weights, want.weights), what
            if gate is None:
                assert got.gate is None
            else:
                assert got.gate is not None and torch.equal(got.gate, want_gate), what


@pytest.mark.parametrize("n", (1, 5))
def test_router_ties_go_to_the_lower_expert(cuda_ops, lean: bool, n: int) -> None:
    """Router rows repeated in runs of 4 (equal logits, equal probabilities, across lanes and
    within one lane's experts): the k chosen are those of top_k, lower ids first among ties."""
    rng = np.random.default_rng(17)
    w, _ = make_weight("F32", 64, 256, rng, "cuda")
    rows = w.data.view(64, -1)
    rows.copy_(rows[torch.arange(64, device="cuda") // 4 * 4].clone())  # 4 equal rows a run
    rows[32:].copy_(rows[:32].clone())  # and experts e, e + 32 equal: one lane's two logits
    h = rand(n, 256, seed=3)
    rt = cuda_ops.route
    for norm in (True, False):
        want = rt.top_k(cuda_ops.linear.matmul(h, w), 10, norm)
        got = rt.router(h, w, 10, norm).route
        assert torch.equal(got.experts, want.experts) and torch.equal(got.weights, want.weights)
        for t in range(n):  # equal weights keep ascending ids
            ids, ws = want.experts[t].tolist(), want.weights[t].tolist()
            assert all(ids[i] < ids[i + 1] for i in range(9) if ws[i] == ws[i + 1]), ids


def test_router_replays_in_a_graph(cuda_ops, lean: bool) -> None:
    """16 routers captured in one graph, replayed 12 times with new inputs, each checked against
    the unfused path: a last CTA that read another CTA's logits before they were visible (its
    ticket's ordering, tickets.cuh) would route on the previous replay's."""
    rng = np.random.default_rng(3)
    w, _ = make_weight("F32", 256, 2560, rng, "cuda")
    hs = [rand(4, 2560, seed=1 + i) for i in range(16)]
    gate_inp = rand(2560, seed=2)
    rt = cuda_ops.route
    rt.router(hs[0], w, 10, True, gate_inp)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [rt.router(h, w, 10, True, gate_inp) for h in hs]
    for replay in range(12):
        for i, h in enumerate(hs):
            h.copy_(rand(4, 2560, seed=100 * replay + i))
        graph.replay()
        torch.cuda.synchronize()
        for i, (h, out) in enumerate(zip(hs, outs, strict=True)):
            want = rt.top_k(cuda_ops.linear.matmul(h, w), 10, True)
            what = f"replay {replay}, router {i}"
            assert torch.equal(out.route.experts, want.experts), what
            assert torch.equal(out.route.weights, want.weights), what
            assert out.gate is not None and torch.equal(out.gate, gate_of(cuda_ops, h, gate_inp))
        assert int(rt.tickets.buf.count_nonzero()) == 0, "a counter left set"


def test_router_refuses_what_it_cannot_fuse(cuda_ops) -> None:
    rng = np.random.default_rng(4)
    rt = cuda_ops.route
    q4, _ = make_weight("Q4_K", 256, 256, rng, "cuda")
    f32, _ = make_weight("F32", 256, 256, rng, "cuda")
    assert not rt.fuses(1, q4, 8)  # a quantized router: the matvec, then top_k
    assert not rt.fuses(9, f32, 8)  # more than 8 tokens
    assert not rt.fuses(1, f32, 33)  # k past one lane per chosen expert
    with pytest.raises(ValueError, match="no fused router"):
        rt.router(rand(1, 256, seed=1), q4, 8, True)
    with pytest.raises(ValueError, match="gate_inp has shape"):
        rt.router(rand(1, 256, seed=1), f32, 8, True, rand(128, seed=2))
    for bad in (0, 3, 16, True):  # a group is a token bucket of the kernels
        with pytest.raises(ValueError, match="route.split_tokens must be one of"):
            rt.split_tokens = bad
    assert rt.split and rt.split_tokens == 1  # the default: groups of 1
    for bad in (0, 13, 2.0, True):
        with pytest.raises(ValueError, match="route.unroll must be an int in 1..12"):
            rt.unroll = bad
    assert rt.unroll == 8 and not rt.batch  # the defaults
    f32_router, _ = make_weight("F32", 256, 256, rng, "cuda")
    rt.lean, rt.batch = False, True  # the batch is the lean router's: refused, not ignored
    try:
        with pytest.raises(ValueError, match="route.batch and route.unroll are the lean"):
            rt.router(rand(1, 256, seed=1), f32_router, 8, True)
    finally:
        rt.lean, rt.batch = True, False


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n", N_TOKENS)
def test_shared_in_down_is_add_shared(cuda_ops, cuda_ops_int8, int8: bool, n: int) -> None:
    from mgserve.cuda.ops.moe import ExpertWeights, SharedExpert

    ops = cuda_ops_int8 if int8 else cuda_ops
    rng = np.random.default_rng(17 + n)
    e, ff, d = 8, 64, 256
    gate, _ = make_weight("Q4_K", e * ff, d, rng, "cuda")
    up, _ = make_weight("Q4_K", e * ff, d, rng, "cuda")
    down, _ = make_weight("Q5_0", e * d, ff, rng, "cuda")
    w = ExpertWeights(gate, up, None, down, e, ff)
    h, x, s = rand(n, d, seed=6), rand(n, d, seed=7), rand(n, d, seed=8)
    gate_inp = rand(d, seed=9)
    ids = torch.randint(0, e, (n, 3), device="cuda", dtype=torch.int32)
    wts = torch.rand(n, 3, device="cuda")
    g = gate_of(ops, h, gate_inp)
    routed = ops.moe.experts(h, w, ids, wts)
    for gated in (True, False):
        for res in (None, x):
            ready: list[int] = []
            shared = SharedExpert(s, g if gated else None, partial(ready.append, 1))
            got = ops.moe.experts(h, w, ids, wts, residual=res, shared=shared)
            want = ops.moe.add_shared(routed, s, h, gate_inp if gated else None, res)
            what = f"int8={int8} N={n} gated={gated} residual={res is not None}"
            assert torch.equal(got, want), what
            assert ready == [1], what
    h9, ids9 = rand(9, d, seed=10), torch.zeros(9, 3, device="cuda", dtype=torch.int32)
    shared9 = SharedExpert(rand(9, d, seed=11), None, lambda: None)
    with pytest.raises(ValueError, match="decode rows"), ops.path.step("prompt"):
        ops.moe.experts(h9, w, ids9, torch.rand(9, 3, device="cuda"), shared=shared9)


@pytest.mark.parametrize("rows", [(1, 1), (2, 1), (8, 1), (3, 1)])
@pytest.mark.parametrize(("n", "ff"), [(1, 640), (3, 96), (8, 64), (5, 160)])
@pytest.mark.parametrize("acq_rel", [False, True], ids=["fences", "acq_rel"])
def test_gate_up_rounds_h_as_quantize(cuda_ops_int8, rows: tuple[int, int], n: int,
                                      ff: int, acq_rel: bool) -> None:  # fmt: skip
    """The int8 gate/up kernel's own rounding of h (the last CTA of each group of 32 rows) gives
    the down kernel quantize_q8's bits: the same output as the kernel without counters (a
    quantize launch). rows (3, 1) (CTAs of 12 rows, across groups) take the quantize launch.
    ``acq_rel``: the tickets by one acq_rel atomic a CTA (Tickets.acq_rel) instead of fences."""
    from mgserve.cuda.ops.moe import ExpertWeights
    from mgserve.cuda.ops.moe_cuda import MoeCuda

    ops = cuda_ops_int8
    rng = np.random.default_rng(n * 1000 + ff + rows[0])
    e, d, kk = 12, 256, 10
    gate_up, _ = make_weight("Q4_K", e * 2 * ff, d, rng, "cuda")
    down, _ = make_weight("Q8_0", e * d, ff, rng, "cuda")
    w = ExpertWeights(None, None, gate_up, down, e, ff)
    h = rand(n, d, seed=n + ff)
    ids = torch.randint(0, e, (n, kk), device="cuda", dtype=torch.int32)
    wts = torch.rand(n, kk, device="cuda")
    made = []
    for tickets in (ops.moe.tickets, None):
        moe = MoeCuda(ops.kernels, ops.moe.fallback, ops.linear, moe_rows=rows, tickets=tickets)
        moe.int8 = moe.round_h = True  # round_h: off by default (slower than the launch)
        made.append(moe)
    assert (made[0]._rounds_h(gate_up, n * kk, ff, kk) is not None) == (32 % (4 * rows[0]) == 0)
    before, ops.moe.tickets.acq_rel = ops.moe.tickets.acq_rel, acq_rel
    try:
        for _ in range(2):  # twice: each launch leaves its counters at 0
            got, want = (m.experts(h, w, ids, wts) for m in made)
            assert torch.equal(got, want), f"rows={rows} N={n} ff={ff}"
            assert int(ops.moe.tickets.buf.count_nonzero()) == 0, "a counter left set"
    finally:
        ops.moe.tickets.acq_rel = before
