"""The bucketed MoE prefill (ops/moe_prefill.py: the cuBLAS path, ``MoeCuda.cublas_prefill``;
test_qgemm.py tests the default grouped path).

CPU (CI): ``plan_moe`` on hand-built counts; the torch MoE prefill against the float64 reference
MoE (several scratch passes, skewed routing); the launches of one layer, counted. GPU (marked):
each moe_prefill.cu kernel against its torch twin on random data and edge cases, the CUDA MoE
prefill against the reference at the target shape, and printed timings. ``OpCount`` here also
serves test_deltanet_chunked.py.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops import moe_prefill
from mgserve.cuda.ops.moe_prefill import MoePrefillTorch, plan_moe
from mgserve.cuda.ops.moe_prefill_cuda import MoePrefillCuda
from tests.cuda.test_moe_torch import (
    RTOL_F16,
    bound_error,
    make_case,
    reference_moe,
)

_VIEWS = {
    "view", "transpose", "slice", "select", "t", "expand", "unsqueeze", "_unsafe_view",
    "diagonal", "alias", "as_strided", "split", "permute", "detach", "reshape", "squeeze",
    "unbind", "split_with_sizes",
}  # fmt: skip


class OpCount(TorchDispatchMode):
    """Counts the aten ops (views apart) run inside the ``with`` block: each is a launch on a
    GPU (or none, for a few host-only ops), so this bounds the host's dispatch work."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


# ---- MoE plan (CPU) ----------------------------------------------------------------------------


def check_plan(counts: np.ndarray, per_pass: int, ratio: float = 1.25, min_rows: int = 64):
    """Every structural promise of plan_moe, for any counts."""
    plan = plan_moe(counts, per_pass, ratio, min_rows)
    used = np.flatnonzero(counts)
    assert sorted(plan.experts.tolist()) == used.tolist()
    assert np.all(np.diff(counts[plan.experts]) <= 0), "experts not by count, descending"
    starts = np.cumsum(counts) - counts
    rows = np.concatenate(
        [starts[e] + np.arange(counts[e]) + plan.shift[e] for e in used] or [np.zeros(0, int)]
    )  # padded row of every sorted position, expert by expert
    assert len(set(rows.tolist())) == rows.size == counts.sum(), "pairs share a padded row"
    assert rows.size == 0 or (rows.min() >= 0 and rows.max() < plan.n_rows)
    seen, row = 0, 0
    for p0, pn, buckets in plan.passes:
        assert p0 == seen and 1 <= pn <= per_pass
        seen += pn
        assert buckets[0].first == p0 and sum(b.n for b in buckets) == pn
        for b in buckets:
            assert b.row0 == row, "buckets not consecutive"
            ex = plan.experts[b.first : b.first + b.n]
            assert b.rows == counts[ex].max()
            if b.rows > min_rows:
                assert counts[ex].min() * ratio >= b.rows, f"bucket {b} pads more than {ratio}"
            for i, e in enumerate(ex):  # expert e's rows sit in its own slot of the bucket
                r = starts[e] + np.arange(counts[e]) + plan.shift[e]
                assert np.all((r >= b.row0 + i * b.rows) & (r < b.row0 + (i + 1) * b.rows))
            row += b.n * b.rows
    assert seen == len(used) and row == plan.n_rows
    return plan


def test_plan_hand_built() -> None:
    counts = np.array([0, 100, 3, 80, 0, 1000, 81, 64, 1, 900, 0])
    plan = check_plan(counts, per_pass=100)
    assert plan.experts.tolist() == [5, 9, 1, 6, 3, 7, 2, 8]
    b = plan.passes[0][2]
    # 1000 and 900 (>= 800), then 100, 81, 80 (>= 80), then the small ones padded to 64
    assert [(x.n, x.rows) for x in b] == [(2, 1000), (3, 100), (3, 64)]
    assert plan.n_rows == 2 * 1000 + 3 * 100 + 3 * 64
    # two experts per pass: buckets never straddle passes
    plan2 = check_plan(counts, per_pass=2)
    assert [pn for _, pn, _ in plan2.passes] == [2, 2, 2, 2]


@pytest.mark.parametrize("seed", range(5))
def test_plan_random(seed: int) -> None:
    rng = np.random.default_rng(seed)
    e = int(rng.integers(1, 300))
    counts = rng.integers(0, 3000, size=e) * (rng.random(e) < 0.8)
    counts[rng.integers(e)] += 1  # at least one used expert
    for per_pass in (1, 7, 1000):
        check_plan(
            counts, per_pass, ratio=float(rng.uniform(1, 2)), min_rows=int(rng.integers(1, 100))
        )


def test_plan_rejects_bad_args() -> None:
    with pytest.raises(ValueError, match="per_pass"):
        plan_moe(np.array([1, 2]), 0)


# ---- MoE prefill, torch (CPU) ------------------------------------------------------------------


def skewed_routing(n: int, kk: int, e: int, rng: np.random.Generator):
    """Expert 11 chosen by every token, the last 4 experts by none, the rest spread unevenly."""
    pool = np.arange(e - 4)
    pool = pool[pool != 11]
    p = rng.uniform(0.1, 1.0, size=pool.size) ** 3
    p /= p.sum()
    rows = [rng.permutation([11, *rng.choice(pool, kk - 1, replace=False, p=p)]) for _ in range(n)]
    experts = torch.from_numpy(np.stack(rows).astype(np.int32))
    weights = torch.from_numpy(rng.uniform(0.05, 1.0, size=(n, kk)).astype(np.float32))
    return experts, weights


@pytest.mark.parametrize(
    ("gate_type", "down_type", "fused"), [("Q4_K", "Q8_0", False), ("Q6_K", "Q5_0", True)]
)
def test_moe_prefill_torch_matches_reference(
    monkeypatch: pytest.MonkeyPatch, gate_type: str, down_type: str, fused: bool
) -> None:
    """300 tokens x 4 of 16 experts, skewed; scratch for all experts, 5 and 1 expert(s) per pass."""
    d = ff = 256
    case = make_case(gate_type, down_type, 16, d, ff, fused=fused, seed=12)
    rng = np.random.default_rng(12)
    x = torch.from_numpy(rng.standard_normal((300, d), dtype=np.float32))
    experts, weights = skewed_routing(300, 4, 16, rng)
    ref, scale = reference_moe(case, x, experts, weights)
    steps = MoePrefillTorch(DenseWeights())
    per_expert = 2 * 3 * ff * d
    for budget in (moe_prefill.MOE_SCRATCH_BYTES, 5 * per_expert, per_expert):
        monkeypatch.setattr(moe_prefill, "MOE_SCRATCH_BYTES", budget)
        y = moe_prefill.moe_prefill(steps, x, case.w, experts, weights)
        err = bound_error(y, ref, scale)
        assert err <= RTOL_F16, f"{gate_type}/{down_type} scratch {budget} B: error {err:.2e}"


class LaunchRecorder:
    """Kernels and a linear family on the CPU that record every launch, dequantization and
    product instead of running it (outputs stay uninitialised): counts what a GPU layer of
    ``MoePrefillCuda`` would launch."""

    device = torch.device("cpu")
    wgmma = False  # qgemm.cu's kernels (a GPU without warpgroup MMA)

    def __init__(self) -> None:
        self.launches: list[str] = []

    def kernel(self, source: str, name: str, defines: tuple[tuple[str, str], ...] = ()) -> str:
        return name

    def launch(self, kernel: object, *args: object, **kw: object) -> None:
        self.launches.append(str(kernel))

    def scratch(self, n_elems: int) -> torch.Tensor:
        return torch.empty(n_elems, dtype=torch.float16)

    def dequant_rows(self, *args: object, **kwargs: object) -> None:
        self.launches.append("dequant")

    def product(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        self.launches.append("bmm")


@pytest.mark.parametrize("fused", [False, True])
def test_moe_prefill_launch_count(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer of 4096 tokens x top-10 of 256 experts (skewed counts, qwen4exp widths; no
    weights are read): 2 or 3 dequantization launches, 4 glue kernels, two products per bucket
    and ~15 small torch ops (sort, counts, tables, allocations), whatever the routing. The old
    path made ~17 torch ops per chunk of ~10 experts (~25 chunks a layer)."""
    from mgserve.cuda.ops.moe import ExpertWeights
    from mgserve.cuda.weights import QuantWeight

    rng = np.random.default_rng(7)
    n, kk, e, d, ff = 4096, 10, 256, 2560, 640

    def qw(name: str, k: int, rows: int) -> QuantWeight:
        return QuantWeight(name, "Q8_0", (k, rows), torch.empty(0, dtype=torch.uint8))

    if fused:
        w = ExpertWeights(None, None, qw("gu", d, 2 * ff * e), qw("dn", ff, d * e), e, ff)
    else:
        w = ExpertWeights(qw("g", d, ff * e), qw("u", d, ff * e), None, qw("dn", ff, d * e), e, ff)
    p = rng.uniform(0.05, 1.0, size=e) ** 4
    p /= p.sum()
    ex = np.stack([rng.choice(e, kk, replace=False, p=p) for _ in range(n)]).astype(np.int32)
    x = torch.zeros(n, d)
    weights = torch.full((n, kk), 0.1)
    rec = LaunchRecorder()
    monkeypatch.setattr(moe_prefill, "f16_bmm_into", rec.product)
    steps = MoePrefillCuda(rec, rec)  # type: ignore[arg-type]
    with OpCount() as c:
        moe_prefill.moe_prefill(steps, x, w, torch.from_numpy(ex), weights)
    plan = plan_moe(np.bincount(ex.flatten(), minlength=e), 10**6)
    n_b = sum(len(b) for _, _, b in plan.passes)
    launches = collections.Counter(rec.launches)
    assert launches["dequant"] == (2 if fused else 3), launches
    assert launches["bmm"] == 2 * n_b, launches
    assert len(launches) == 6 and sum(launches.values()) == 4 + launches["dequant"] + 2 * n_b
    assert c.total <= 16, f"{c.total} torch ops besides the launches: {dict(c.ops)}"
    print(f"moe prefill launches: {dict(launches)} + {c.total} torch ops ({n_b} buckets)")


# ---- GPU ---------------------------------------------------------------------------------------


def gpu_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


@pytest.mark.gpu
def test_moe_kernels_match_torch(cuda_ops) -> None:
    """Each glue kernel == its torch twin: row maps and gathers exactly, silu * up within one f16
    rounding, the combine within fp32 rounding; d = 2560 (float4 paths), d = 30 (scalar), one
    expert and kk = 1, and a misaligned x (scalar gather)."""
    rng = np.random.default_rng(5)
    steps = MoePrefillTorch(DenseWeights())
    for n, kk, e, d, ff in ((600, 10, 64, 2560, 640), (9, 3, 5, 30, 14), (12, 1, 1, 64, 32)):
        experts = torch.from_numpy(rng.integers(0, e, size=(n, kk)).astype(np.int32)).cuda()
        flat = experts.reshape(-1)
        sorted_e, order = torch.sort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e).cpu().numpy()
        plan = plan_moe(counts, 10**6)
        shift = torch.from_numpy(plan.shift).cuda()
        got = cuda_ops.moe.prefill.rows(sorted_e, order, shift, kk, plan.n_rows)
        want = steps.rows(sorted_e, order, shift, kk, plan.n_rows)
        for name, a, b in zip(("pair_row", "row_token"), got, want, strict=True):
            assert torch.equal(a, b), f"{name} (n {n}, kk {kk}): {(a != b).sum()} entries differ"
        pair_row, row_token = got
        x = torch.randn(n, d, device="cuda") * 3
        xs = cuda_ops.moe.prefill.gather(x, row_token)
        assert torch.equal(xs, steps.gather(x, row_token)), f"gather d {d}"
        shifted = torch.empty(n * d + 1, device="cuda")[1:].view(n, d)  # misaligned: scalar path
        shifted.copy_(x)
        assert torch.equal(cuda_ops.moe.prefill.gather(shifted, row_token), xs), (
            f"misaligned gather d {d}"
        )
        gu = torch.randn(plan.n_rows, 2 * ff, device="cuda") * 4
        h = torch.empty(plan.n_rows, ff, dtype=torch.float16, device="cuda")
        h_ref = torch.empty_like(h)
        cuda_ops.moe.prefill.silu_mul(gu, h)
        steps.silu_mul(gu, h_ref)
        torch.testing.assert_close(  # one f16 rounding apart at most
            h.float(),
            h_ref.float(),
            rtol=2**-9,
            atol=1e-6,
            msg=lambda m, ff=ff: f"silu_mul ff {ff}: {m}",
        )
        y = torch.randn(plan.n_rows, d, device="cuda")
        w = torch.rand(n, kk, device="cuda")
        out = cuda_ops.moe.prefill.combine(y, pair_row.view(n, kk), w)
        ref = steps.combine(y, pair_row.view(n, kk), w)
        err = (out - ref).abs().max().item()
        assert err <= 1e-5, f"combine d {d}: max error {err:.2e}"


@pytest.mark.gpu
def test_moe_prefill_cuda_matches_reference(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_experts N > 8 on the bucketed cuBLAS path against the float64 reference: skewed
    routing over 16 experts with one and several scratch passes, and 9 tokens."""
    monkeypatch.setattr(cuda_ops.moe, "cublas_prefill", True)
    d = ff = 256
    case = make_case("Q4_K", "Q8_0", 16, d, ff, fused=False, seed=13, device="cuda")
    rng = np.random.default_rng(13)
    x = torch.from_numpy(rng.standard_normal((300, d), dtype=np.float32))
    experts, weights = skewed_routing(300, 4, 16, rng)
    ref, scale = reference_moe(case, x, experts, weights)
    per_expert = 2 * 3 * ff * d
    for budget in (moe_prefill.MOE_SCRATCH_BYTES, 5 * per_expert, per_expert):
        monkeypatch.setattr(moe_prefill, "MOE_SCRATCH_BYTES", budget)
        y = cuda_ops.moe.experts(x.cuda(), case.w, experts.cuda(), weights.cuda()).cpu()
        err = bound_error(y, ref, scale)
        assert err <= RTOL_F16, f"scratch {budget} B: error {err:.2e}"
    y9 = cuda_ops.moe.experts(x[:9].cuda(), case.w, experts[:9].cuda(), weights[:9].cuda()).cpu()
    err = bound_error(y9, ref[:9], scale[:9])
    assert err <= RTOL_F16, f"9 tokens: error {err:.2e}"


@pytest.mark.gpu
def test_moe_prefill_target_shape(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen4exp's layer (d 2560, ff 640, 256 experts, top-10), 4096 tokens with skewed routing, on
    the bucketed cuBLAS path: checked on 64 tokens against the fp32 decode path, timed (printed)
    over all 4096 (test_qgemm.py times the grouped path)."""
    from tests.cuda.test_moe import target_case

    monkeypatch.setattr(cuda_ops.moe, "cublas_prefill", True)
    case = target_case("Q8_0")
    rng = np.random.default_rng(14)
    n, kk, e = 4096, 10, 256
    x = torch.from_numpy(rng.standard_normal((n, 2560), dtype=np.float32))
    p = rng.uniform(0.05, 1.0, size=e) ** 4
    p /= p.sum()
    ex = np.stack([rng.choice(e, kk, replace=False, p=p) for _ in range(n)]).astype(np.int32)
    experts = torch.from_numpy(ex)
    weights = torch.from_numpy(rng.uniform(0.05, 1.0, size=(n, kk)).astype(np.float32))
    xc, ec, wc = x.cuda(), experts.cuda(), weights.cuda()
    y = cuda_ops.moe.experts(xc, case.w, ec, wc)  # [N, d] the prefill path
    # the fp32 decode kernels (checked against the reference in test_moe.py) on 64 tokens,
    # 8 at a time; f16 rounding stays ~1e-3 of |y|, a wrong expert or row is off by O(|y|)
    sub = torch.from_numpy(rng.choice(n, 64, replace=False)).cuda()
    want = torch.cat(
        [cuda_ops.moe.experts(xc[i], case.w, ec[i], wc[i]) for i in sub.split(8)]
    )  # [64, d]
    err = ((y[sub] - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-2, f"target shape: max error {err:.2e} of max |y|"
    ms = gpu_ms(lambda: cuda_ops.moe.experts(xc, case.w, ec, wc))
    counts = np.bincount(ex.flatten(), minlength=e)
    plan = plan_moe(counts, 10**6)
    n_b = sum(len(b) for _, _, b in plan.passes)
    print(
        f"moe prefill 4096 x top-10 / 256: {ms:.2f} ms per layer, {n_b} buckets, "
        f"padded rows {plan.n_rows} / {n * kk} pairs, max count {counts.max()}"
    )
