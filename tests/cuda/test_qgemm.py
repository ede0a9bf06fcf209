"""The tensor-core prompt GEMMs on GGUF blocks (kernels/qgemm.cu, ops/qgemm.py) and the grouped
MoE prefill built on them (``MoePrefillCuda.grouped``).

CPU (CI): tuning validation, the grouped grid's worst-case bound and tile tables, the grouped
path's launches and its lack of host reads (fake kernels), and, with nvcc, the registers and
spills of the main instantiations. GPU (marked):

- ``matmul`` against float64 products for every format, M in {9, 17, 64, 100, 4096}, n_out
  not a multiple of the tile (1, 7, 129, 200), k of one block to several and k tails of a step.
  Two bounds, as error / (|x| @ |W|^T): vs the exact product (x and W unrounded) <= RTOL_F16
  (2e-3: f16 operands); vs the product of the f16-rounded operands <= ACC_TOL (1e-4: fp32
  accumulation, and the rare W value whose fp32 decode differs from gguf-py's by an ulp and so
  rounds to the neighbouring f16; a wrong fragment, row or scale is off by O(1e-2) or more).
- batch invariance (torch.equal): rows computed in a batch of 4096 random rows == the same rows
  alone, in sub-batches of other sizes and permuted; and == under other tile shapes (tunings).
- the grouped MoE prefill against the float64 reference (RTOL_F16 of the MoE scale, see
  test_moe_torch.py) and against the bucketed cuBLAS path (2 x RTOL_F16), and bitwise invariant
  to the other tokens' number and routing; captured into a CUDA graph (no host sync).
- printed timings at qwen4exp's shapes, qgemm against the dequant + cuBLAS path.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops.qgemm import GroupedRows, QGemm, QGemmTuning, grouped_tiles
from mgserve.cuda.weights import FORMATS
from tests.cuda.test_moe_prefill import LaunchRecorder, OpCount, gpu_ms, skewed_routing
from tests.cuda.test_moe_torch import (
    RTOL_F16,
    bound_error,
    make_case,
    make_weight,
    reference_moe,
)

TYPES = sorted(FORMATS)
ACC_TOL = 1e-4  # vs the float64 product of the f16-rounded operands (module docstring)
TUNINGS = [
    QGemmTuning(),  # the dense default
    QGemmTuning(bm=64),  # the grouped default
    QGemmTuning(64, 64, 64, 2, 2, 1),  # 4 warps, k steps of 64: other k tails
    QGemmTuning(32, 64, 16, 1, 2, 1),  # 2 warps, k steps of 16
]


# ---- CPU -----------------------------------------------------------------------------------------


def test_tuning_validation() -> None:
    for t in TUNINGS:
        assert t.smem_bytes <= 48 * 1024
        assert dict(t.defines("Q4_K"))["QG_TYPE"] == "Q4_K"
    assert QGemmTuning.parse("64,128,32,2,4") == QGemmTuning(bm=64)
    assert QGemmTuning.parse("32,64,16,1,2,1") == TUNINGS[3]
    bad = [
        dict(bk=24),  # not a step of whole k16 products
        dict(bm=48),  # not 16 x warps_m
        dict(bn=96),  # not 16 x warps_n
        dict(bm=256, bn=256, bk=64),  # 147 KB of shared memory
        dict(warps_m=4, warps_n=8),  # 32 warps
        dict(bm=32, bn=64, bk=16, warps_m=2, warps_n=4),  # 256 threads for 64 X copies
        dict(min_ctas=0),
    ]
    for kw in bad:
        with pytest.raises(ValueError, match="QGemmTuning"):
            QGemmTuning(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tuning"):
        QGemmTuning.parse("1,2,3")


@pytest.mark.parametrize("seed", range(4))
def test_grouped_rows_and_grid_bound(seed: int) -> None:
    """GroupedRows on the CPU == numpy, and the worst-case grid covers every tile, for random
    skewed counts and the extremes (all pairs on one expert, one pair per expert)."""
    rng = np.random.default_rng(seed)
    e, bm = int(rng.integers(1, 300)), int(rng.choice([16, 64, 128]))
    cases = [
        rng.integers(0, 500, size=e) * (rng.random(e) < 0.7),
        np.eye(1, e, int(rng.integers(e)), dtype=np.int64)[0] * 1000,
        np.ones(e, dtype=np.int64),
    ]
    for counts in cases:
        p = int(counts.sum())
        sorted_e = torch.from_numpy(np.repeat(np.arange(e), counts).astype(np.int32))
        rows = GroupedRows(sorted_e, e, bm)
        starts = np.concatenate([[0], np.cumsum(counts)])
        tiles = -(-counts // bm)
        assert rows.row_start.tolist() == starts.tolist()
        assert rows.tile_start.tolist() == np.concatenate([[0], np.cumsum(tiles)]).tolist()
        assert tiles.sum() <= grouped_tiles(p, e, bm) == rows.grid_y
    assert grouped_tiles(0, 5, 64) == 0


def test_grouped_launches_without_host_reads() -> None:
    """One layer of 4096 tokens x top-10 of 256 experts on the grouped path, kernels recorded on
    the CPU: the row maps, the two grouped products and the combine, and a fixed set of small
    torch ops with no read of a device value on the host (no .item(), no .cpu())."""
    from mgserve.cuda.ops.moe import ExpertWeights
    from mgserve.cuda.ops.moe_prefill_cuda import MoePrefillCuda
    from mgserve.cuda.weights import QuantWeight

    n, kk, e, d, ff = 4096, 10, 256, 2560, 640
    rec = LaunchRecorder()
    rec.qgemm = QGemm(rec)  # type: ignore[attr-defined, arg-type]

    def qw(name: str, k: int, rows: int) -> QuantWeight:
        return QuantWeight(name, "Q4_K", (k, rows), torch.empty(0, dtype=torch.uint8))

    w = ExpertWeights(qw("g", d, ff * e), qw("u", d, ff * e), None, qw("dn", ff, d * e), e, ff)
    rng = np.random.default_rng(3)
    experts, weights = skewed_routing(n, kk, e, rng)
    steps = MoePrefillCuda(rec, rec)  # type: ignore[arg-type]
    with OpCount() as c:
        steps.grouped(torch.zeros(n, d), w, experts, weights)
    launches = collections.Counter(rec.launches)
    want = {"moe_pair_rows": 1, "qgemm_gate_up": 1, "qgemm_down": 1, "moe_combine": 1}
    assert launches == want, launches
    host_reads = {"_local_scalar_dense", "item", "tolist"} & set(c.ops)
    assert not host_reads, f"host reads of device values: {host_reads}"
    assert c.total <= 16, f"{c.total} torch ops besides the launches: {dict(c.ops)}"


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
@pytest.mark.parametrize(("type_name", "tuning"), [("Q4_K", 0), ("Q6_K", 1), ("Q8_0", 0)])
def test_resource_usage(type_name: str, tuning: int, tmp_path: Path) -> None:
    """ptxas for sm_90: no spills, registers within the min_ctas cap (printed)."""
    from mgserve.cuda import compiler

    t = TUNINGS[tuning]
    src = tmp_path / "qgemm.cu"
    src.write_text(compiler.expand_includes(compiler.KERNEL_DIR / "qgemm.cu"))
    defs = [f"-D{k}={v}" for k, v in t.defines(type_name)]
    cmd = [NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "--resource-usage", *defs, str(src)]
    run = subprocess.run(
        [*cmd, "-o", str(tmp_path / "q.cubin")], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", run.stderr)]
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", run.stderr)
    assert len(regs) == 3 and all(int(s) == 0 for s in spills), run.stderr
    assert max(regs) * t.threads * t.min_ctas <= 65536
    print(f"qgemm {type_name} {t}: registers {regs}, no spills")


# ---- GPU: dense ----------------------------------------------------------------------------------


def k_values(type_name: str) -> list[int]:
    """Reduction lengths: one block, a few blocks, and lengths with a partial last k step."""
    block = FORMATS[type_name].block
    if block == 256:
        return [256, 768]
    if block == 32:
        return [96, 544]
    return [40, 520]


def check_dense(qg: QGemm, w, x: torch.Tensor, label: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """qg.matmul(x, W) against the float64 products (module docstring); returns y (GPU)."""
    y = qg.matmul(x, w)
    torch.cuda.synchronize()
    assert y.shape == (x.shape[0], w.rows) and torch.isfinite(y).all(), f"{label}: unwritten"
    dense = DenseWeights()(w).double()  # [rows, k]
    x64 = x.double()
    scale = x64.abs() @ dense.abs().T
    exact = bound_error(y, (x64 @ dense.T).cpu(), scale.cpu())
    rounded = x.half().double() @ dense.half().double().T
    acc = bound_error(y, rounded.cpu(), scale.cpu())
    assert exact <= RTOL_F16, f"{label}: error {exact:.2e} vs the exact product"
    assert acc <= ACC_TOL, f"{label}: error {acc:.2e} vs the f16-operand product"
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", TYPES)
def test_qgemm_matches_reference(ops, type_name: str) -> None:
    rng = np.random.default_rng(TYPES.index(type_name))
    for k in k_values(type_name):
        for m, n_out in ((9, 200), (17, 129), (64, 1), (100, 7), (4096, 96)):
            w, _ = make_weight(type_name, n_out, k, rng, "cuda")
            x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).cuda()
            check_dense(ops.qgemm, w, x, f"{type_name} M={m} n_out={n_out} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16", "BF16"])
def test_qgemm_batch_invariant(kernels, ops, type_name: str) -> None:
    """Rows of a 4096-row batch == the same rows alone, in batches of 9, 17, 64 and 100, and
    permuted (bitwise); the same under each tuning of TUNINGS (k steps 16, 32, 64 included)."""
    rng = np.random.default_rng(40 + TYPES.index(type_name))
    k = k_values(type_name)[-1]
    w, _ = make_weight(type_name, 200, k, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((4096, k), dtype=np.float32)).cuda() * 2
    full = check_dense(ops.qgemm, w, x, f"{type_name} M=4096")
    for rows in (slice(5, 6), slice(0, 9), slice(100, 117), slice(4032, 4096), slice(7, 107)):
        assert torch.equal(ops.qgemm.matmul(x[rows], w), full[rows]), f"{type_name} rows {rows}"
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(ops.qgemm.matmul(x[perm], w), full[perm]), f"{type_name} permuted"
    assert torch.equal(ops.matmul(x[:100], w), full[:100]), "LinearCuda.matmul, N = 100"
    for t in TUNINGS[1:]:
        other = QGemm(kernels, tuning=t)
        assert torch.equal(other.matmul(x, w), full), f"{type_name}: tuning {t} differs"


@pytest.mark.gpu
def test_qgemm_f16_input_and_out(ops) -> None:
    """An f16 x is used as is; ``out`` is written in place."""
    rng = np.random.default_rng(9)
    w, _ = make_weight("Q4_K", 130, 512, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((33, 512), dtype=np.float32)).cuda()
    out = torch.full((33, 130), float("nan"), device="cuda")
    assert ops.qgemm.matmul(x.half(), w, out=out) is out
    assert torch.equal(out, ops.qgemm.matmul(x, w))


# ---- GPU: grouped MoE ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("gate_type", "down_type", "fused"),
    [
        ("Q4_K", "Q8_0", False),
        ("Q6_K", "Q5_0", True),
        ("Q5_0", "Q4_K", False),
        ("F16", "BF16", True),
    ],
)
def test_grouped_moe_matches_reference(
    cuda_ops, monkeypatch: pytest.MonkeyPatch, gate_type: str, down_type: str, fused: bool
) -> None:
    """300 tokens x 4 of 16 experts, skewed (expert 11 on every token, 12..15 on none), d 256,
    ff 320 (not a multiple of the 128-column tile; 512 where the down projection is a K-quant,
    whose rows are whole 256-value blocks): the grouped path against the float64 reference, and
    against the bucketed cuBLAS path."""
    d, ff = 256, (512 if down_type.endswith("_K") else 320)
    case = make_case(gate_type, down_type, 16, d, ff, fused=fused, seed=21, device="cuda")
    rng = np.random.default_rng(21)
    x = torch.from_numpy(rng.standard_normal((300, d), dtype=np.float32))
    experts, weights = skewed_routing(300, 4, 16, rng)
    ref, scale = reference_moe(case, x, experts, weights)
    args = (x.cuda(), case.w, experts.cuda(), weights.cuda())
    y = cuda_ops.moe.experts(*args).cpu()
    err = bound_error(y, ref, scale)
    assert err <= RTOL_F16, f"{gate_type}/{down_type}: grouped error {err:.2e}"
    monkeypatch.setattr(cuda_ops.moe, "cublas_prefill", True)
    old = cuda_ops.moe.experts(*args).cpu()
    diff = bound_error(y, old.double(), scale)
    assert diff <= 2 * RTOL_F16, f"{gate_type}/{down_type}: grouped vs cuBLAS path {diff:.2e}"
    print(f"grouped moe {gate_type}/{down_type}: error {err:.1e}, vs cuBLAS path {diff:.1e}")


@pytest.mark.gpu
def test_grouped_moe_batch_invariant(cuda_ops) -> None:
    """20 tokens' results, bitwise: alone (and token 0 on its own, N = 1), beside 300 tokens of
    random routing, and beside 300 tokens all routed to token 0's experts (which moves every
    expert's tile boundaries)."""
    d, ff, e, kk = 256, 256, 16, 4
    case = make_case("Q4_K", "Q6_K", e, d, ff, fused=False, seed=22, device="cuda")
    rng = np.random.default_rng(22)
    x = torch.from_numpy(rng.standard_normal((320, d), dtype=np.float32)).cuda()
    experts, weights = (t.cuda() for t in skewed_routing(320, kk, e, rng))
    grouped = cuda_ops.moe.prefill.grouped
    alone = grouped(x[:20], case.w, experts[:20], weights[:20])
    assert torch.equal(grouped(x[:1], case.w, experts[:1], weights[:1]), alone[:1]), "N = 1"
    beside = grouped(x, case.w, experts, weights)
    assert torch.equal(beside[:20], alone), "beside 300 randomly routed tokens"
    crowd = experts.clone()
    crowd[20:] = experts[0]
    same = grouped(x, case.w, crowd, weights)
    assert torch.equal(same[:20], alone), "beside 300 tokens on token 0's experts"


@pytest.mark.gpu
def test_grouped_moe_graph_capture(cuda_ops) -> None:
    """The grouped path reads nothing back on the host: it captures into a CUDA graph, and the
    replay on new inputs equals an eager run."""
    case = make_case("Q4_K", "Q8_0", 16, 256, 256, fused=True, seed=23, device="cuda")
    rng = np.random.default_rng(23)
    x = torch.from_numpy(rng.standard_normal((64, 256), dtype=np.float32)).cuda()
    experts, weights = (t.cuda() for t in skewed_routing(64, 4, 16, rng))
    grouped = cuda_ops.moe.prefill.grouped
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped(x, case.w, experts, weights)  # compile and warm the allocator
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped(x, case.w, experts, weights)
    x.copy_(torch.randn_like(x))
    experts.copy_(experts.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, grouped(x, case.w, experts, weights))


# ---- GPU: timings at the target shapes -----------------------------------------------------------


@pytest.mark.gpu
def test_qgemm_timing(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed: 4096 tokens through a 2560 x 2560 Q4_K / Q5_0 / Q6_K / Q8_0 weight and the
    qwen4exp MoE layer (4096 x top-10 of 256, Q4_K gate/up, Q5_0 down), qgemm vs cuBLAS."""
    from tests.cuda.test_moe import target_case

    rng = np.random.default_rng(24)
    x = torch.from_numpy(rng.standard_normal((4096, 2560), dtype=np.float32)).cuda()
    lin = cuda_ops.linear
    for t in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
        w, _ = make_weight(t, 2560, 2560, rng, "cuda")
        new = gpu_ms(lambda w=w: lin.matmul(x, w))
        monkeypatch.setattr(lin, "cublas_prefill", True)
        old = gpu_ms(lambda w=w: lin.matmul(x, w))
        monkeypatch.setattr(lin, "cublas_prefill", False)
        tflops = 2 * 4096 * 2560 * 2560 / new / 1e9
        print(
            f"linear {t} 4096x2560x2560: qgemm {new:.3f} ms ({tflops:.0f} TFLOP/s), "
            f"cuBLAS {old:.3f} ms"
        )
    if os.environ.get("MGSERVE_QGEMM_SWEEP"):  # other dense tilings on the Q4_K weight
        w, _ = make_weight("Q4_K", 2560, 2560, rng, "cuda")
        for spec in ("64,128,32,2,4", "128,64,32,4,2", "64,64,64,2,2", "128,128,16,2,4,2"):
            alt = QGemm(lin.kernels, tuning=QGemmTuning.parse(spec))
            ms = gpu_ms(lambda alt=alt, w=w: alt.matmul(x.half(), w))
            print(f"qgemm Q4_K 4096x2560x2560 tiles {spec}: {ms:.3f} ms")
    case = target_case("Q5_0")
    n, kk, e = 4096, 10, 256
    p = rng.uniform(0.05, 1.0, size=e) ** 4
    p /= p.sum()
    ex = np.stack([rng.choice(e, kk, replace=False, p=p) for _ in range(n)]).astype(np.int32)
    experts = torch.from_numpy(ex).cuda()
    weights = torch.from_numpy(rng.uniform(0.05, 1.0, size=(n, kk)).astype(np.float32)).cuda()
    run = lambda: cuda_ops.moe.experts(x, case.w, experts, weights)  # noqa: E731
    y = run()
    new = gpu_ms(run)
    monkeypatch.setattr(cuda_ops.moe, "cublas_prefill", True)
    old = gpu_ms(run)
    diff = ((run() - y).abs().max() / y.abs().max()).item()
    assert diff <= 1e-2, f"target MoE: qgemm vs cuBLAS path {diff:.2e} of max |y|"
    print(f"moe prefill 4096 x top-10 / 256: qgemm {new:.2f} ms, cuBLAS {old:.2f} ms per layer")
