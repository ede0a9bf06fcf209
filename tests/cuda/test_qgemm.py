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
import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops.f16_rows import F16Rows
from mgserve.cuda.ops.grouped_rows import GroupedRows, grouped_tiles
from mgserve.cuda.ops.hgemm import HGemm, HGemmTuning
from mgserve.cuda.ops.qgemm import QGemm, QGemmTuning
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
    QGemmTuning(bm=64),  # the grouped default until 2026-12-06
    QGemmTuning(64, 64, 64, 2, 2, 1),  # 4 warps, k steps of 64: other k tails
    QGemmTuning(32, 64, 16, 1, 2, 1),  # 2 warps, k steps of 16
]
GROUPED_TUNINGS = [  # the MoE tilings bench model --moe-tiles compares (gpu_stages.sh moetiles2)
    QGemmTuning(bm=64),
    QGemmTuning(128, 128, 32, 4, 2, 2),  # 4 x 2 warps
    QGemmTuning(128, 64, 32, 4, 2, 2),  # 64 columns
    QGemmTuning(128, 128, 32, 2, 4, 1),  # one CTA an SM: registers past the cap of two
    QGemmTuning(192, 96, 16, 3, 2, 1),  # 6 warps: ~160 rows an expert in one tile
    QGemmTuning(160, 160, 16, 5, 2, 1),  # 10 warps
]
HG_TUNINGS = [
    HGemmTuning(),  # the default: 128 x 256 x 32, 4 stages, 2 x 4 warps
    HGemmTuning(128, 128, 32, 3, 2, 4, 2),  # 2 CTAs an SM
    HGemmTuning(256, 128, 64, 3, 4, 2),  # k steps of 64, 4 x 2 warps
    HGemmTuning(64, 64, 16, 2, 2, 2, 1, 1),  # 4 warps, k steps of 16, 2 stages, plain CTA order
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
    rec.x16 = F16Rows()  # type: ignore[attr-defined]  # LinearCuda's

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


class _SmemRecorder(LaunchRecorder):
    """LaunchRecorder on the wgmma path, keeping each kernel's allowed and launched smem."""

    wgmma = True

    def __init__(self) -> None:
        super().__init__()
        self.smem: list[tuple[str, int, int]] = []  # (kernel, allowed, launched)
        self._allowed = 0

    def kernel(self, source: str, name: str, defines: tuple = (), smem: int = 0,
               sm90a: bool = False) -> str:  # fmt: skip
        self._allowed = smem
        return name

    def launch(self, kernel: object, *args: object, **kw: object) -> None:
        super().launch(kernel, *args, **kw)
        self.smem.append((str(kernel), self._allowed, int(kw.get("shmem", 0))))  # type: ignore[call-overload]


def test_room_pads_the_wgmma_ctas_shared_memory() -> None:
    """qgemm.room: a wgmma CTA launched (and allowed) with that many bytes beyond its tiles, so
    fewer fit an SM (a prefill lane leaving room to decode blocks); refused past 227 KB."""
    from mgserve.cuda.ops.wgmma import MAX_SMEM, QWgmmaTuning
    from mgserve.cuda.weights import QuantWeight

    rec = _SmemRecorder()
    q = QGemm(rec)  # type: ignore[arg-type]
    w = QuantWeight("w", "Q4_K", (256, 128), torch.empty(0, dtype=torch.uint8))
    tiles = QWgmmaTuning().smem_bytes
    for room in (0, 51200):
        q.room = room
        q._launch(q.tuning, "qgemm", "Q4_K", 128, None, 4096, label=w.name)
        assert rec.smem[-1] == ("qgemm_wg", tiles + room, tiles + room)
    assert 2 * (tiles + 51200 + 1024) > 228 * 1024  # one CTA an SM where two fitted
    for bad in (-1, MAX_SMEM - tiles + 1, 1.5):
        q.room = bad  # type: ignore[assignment]
        with pytest.raises(ValueError, match="qgemm.room"):
            q._launch(q.tuning, "qgemm", "Q4_K", 128, None, 4096, label=w.name)


def test_hgemm_tuning_validation() -> None:
    for t in HG_TUNINGS:
        assert t.smem_bytes <= 227 * 1024
        assert dict(t.defines())["HG_STAGES"] == str(t.stages)
    assert HGemmTuning.parse("128,256,32,4,2,4") == HGemmTuning()
    assert HGemmTuning.parse("64,64,16,2,2,2,1,1,256") == HG_TUNINGS[3]
    assert HGemmTuning.parse("128,256,32,4,2,4,1,8,9").min_rows == 9
    bad = [
        dict(bk=128),  # no swizzle for 16 chunks a row
        dict(stages=1),  # no ring
        dict(bm=48),  # not 16 x warps_m
        dict(bn=96),  # not 16 x warps_n
        dict(bm=256, bn=256, bk=64, stages=4),  # 256 KB of shared memory
        dict(warps_m=4, warps_n=8),  # 32 warps
        dict(bm=32, bn=64, bk=16),  # 256 threads for 64 X copies
        dict(min_ctas=0),
        dict(group_m=0),
        dict(min_rows=0),
    ]
    for kw in bad:
        with pytest.raises(ValueError, match="HGemmTuning"):
            HGemmTuning(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tuning"):
        HGemmTuning.parse("128,256,32")


NVCC = shutil.which("nvcc")


def ptxas_usage(source: str, defs: list[str], tmp_path: Path) -> tuple[list[int], str]:
    """nvcc -cubin for sm_90 of kernels/``source`` with -D ``defs``: the registers of each
    kernel (ptxas --resource-usage) and the log; asserts a clean compile without spills."""
    from mgserve.cuda import compiler

    src = tmp_path / source
    src.write_text(compiler.expand_includes(compiler.KERNEL_DIR / source))
    cmd = [NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "--resource-usage", *defs, str(src)]
    run = subprocess.run(
        [*cmd, "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", run.stderr)
    assert all(int(s) == 0 for s in spills), run.stderr
    return [int(r) for r in re.findall(r"Used (\d+) registers", run.stderr)], run.stderr


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
@pytest.mark.parametrize(("type_name", "tuning"), [("Q4_K", 0), ("Q6_K", 1), ("Q8_0", 0)])
def test_resource_usage(type_name: str, tuning: int, tmp_path: Path) -> None:
    """ptxas for sm_90: no spills, registers within the min_ctas cap (printed)."""
    t = TUNINGS[tuning]
    defs = [f"-D{k}={v}" for k, v in t.defines(type_name)]
    regs, log = ptxas_usage("qgemm.cu", defs, tmp_path)
    assert len(regs) == 4, log  # qgemm, qgemm_gate_up, qgemm_down, qgemm_dequant
    assert max(regs) * t.threads * t.min_ctas <= 65536
    print(f"qgemm {type_name} {t}: registers {regs}, no spills")


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
@pytest.mark.parametrize("tuning", range(len(HG_TUNINGS)))
def test_hgemm_resource_usage(tuning: int, tmp_path: Path) -> None:
    """hgemm.cu under each tuning of HG_TUNINGS: no spills, registers within the min_ctas cap,
    and its shared ring fits min_ctas CTAs an SM (228 KB, 1 KB reserved a CTA)."""
    t = HG_TUNINGS[tuning]
    regs, log = ptxas_usage("hgemm.cu", [f"-D{k}={v}" for k, v in t.defines()], tmp_path)
    assert len(regs) == 1, log
    assert regs[0] * t.threads * t.min_ctas <= 65536
    assert (t.smem_bytes + 1024) * t.min_ctas <= 228 * 1024
    print(f"hgemm {t}: {regs[0]} registers, {t.smem_bytes} B shared, no spills")


# ---- GPU: dense ----------------------------------------------------------------------------------


def k_values(type_name: str) -> list[int]:
    """Reduction lengths: one block, a few blocks, and lengths with a partial last k step."""
    block = FORMATS[type_name].block
    if block == 256:
        return [256, 768]
    if block == 32:
        return [96, 544]
    return [40, 520]


def check_dense(product, w, x: torch.Tensor, label: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """product(x, W) against the float64 products (module docstring); returns y (GPU)."""
    y = product(x, w)
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
            check_dense(ops.qgemm.matmul, w, x, f"{type_name} M={m} n_out={n_out} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16", "BF16"])
def test_qgemm_batch_invariant(kernels, ops, type_name: str) -> None:
    """Rows of a 4096-row batch == the same rows alone, in batches of 9, 17, 64 and 100, and
    permuted (bitwise); the same under each tuning of TUNINGS (k steps 16, 32, 64 included)."""
    rng = np.random.default_rng(40 + TYPES.index(type_name))
    k = k_values(type_name)[-1]
    w, _ = make_weight(type_name, 200, k, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((4096, k), dtype=np.float32)).cuda() * 2
    full = check_dense(ops.qgemm.matmul, w, x, f"{type_name} M=4096")
    for rows in (slice(5, 6), slice(0, 9), slice(100, 117), slice(4032, 4096), slice(7, 107)):
        assert torch.equal(ops.qgemm.matmul(x[rows], w), full[rows]), f"{type_name} rows {rows}"
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(ops.qgemm.matmul(x[perm], w), full[perm]), f"{type_name} permuted"
    assert torch.equal(ops.matmul(x[:100], w), full[:100]), "LinearCuda.matmul, N = 100"
    for t in TUNINGS[1:]:
        other = QGemm(kernels, tuning=t, wgmma=False)
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


# ---- GPU: dense, W decoded once (hgemm.cu) -------------------------------------------------------


def prompt_rows(ops, x: torch.Tensor, w) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """LinearCuda.matmul as in a prompt step: the prompt GEMMs at any N (1 and 7 included)."""
    with ops.path.step("prompt"):
        return ops.matmul(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", TYPES)
def test_hgemm_matches_reference(ops, type_name: str) -> None:
    """LinearCuda.matmul on the dequantize-once path (>= min_rows = 256 rows: QGemm.dequantize,
    then hgemm.cu, or its wgmma twin on sm_90) against the float64 products, as ``check_dense``
    bounds them; n_out 1, 7, 129, 300 (not multiples of the 256-column tile), k as in
    test_qgemm_matches_reference (partial last k steps); and bitwise equal to the per-CTA decode
    path on the same rows."""
    assert ops.hgemm.tuning.min_rows == 256
    rng = np.random.default_rng(60 + TYPES.index(type_name))
    for k in k_values(type_name):
        for m, n_out in ((256, 300), (300, 129), (4096, 7), (257, 1)):
            w, _ = make_weight(type_name, n_out, k, rng, "cuda")
            x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).cuda()
            label = f"{type_name} M={m} n_out={n_out} k={k}"
            y = check_dense(lambda x, w: prompt_rows(ops, x, w), w, x, label)
            assert torch.equal(y, ops.qgemm.matmul(x, w)), f"{label}: hgemm path != qgemm"


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16", "BF16"])
def test_hgemm_bitwise_across_m(kernels, ops, monkeypatch: pytest.MonkeyPatch, type_name: str):
    """The rule that lets the path depend on M: row i is bitwise the same whichever path runs.
    ``want`` = the backend's per-CTA decode (qgemm.cu, or qgemm_wgmma.cu on sm_90) on all 4096
    rows of x; then the first M rows, M in
    (1, 7, 300, 4096), through LinearCuda.matmul as a prompt step (M 1, 7: qgemm.cu; 300, 4096:
    W decoded once + hgemm.cu) must equal want's first M rows (torch.equal), and so must:
    each tuning of HG_TUNINGS with min_rows 1 (every M on hgemm.cu; k steps 16, 32 and 64,
    2..4 stages, other warp layouts and CTA orders); row tiles of 41 W rows (SCRATCH_BYTES:
    several dequantize + hgemm launches, outputs at odd column offsets: scalar stores); a
    permutation of the 4096 rows; the 300 rows in the middle of x (other tile boundaries)."""
    from mgserve.cuda.ops import linear_cuda

    rng = np.random.default_rng(70 + TYPES.index(type_name))
    k = k_values(type_name)[-1]  # 768, 544 or 520: k % 64 != 0 except for 768
    w, _ = make_weight(type_name, 300, k, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((4096, k), dtype=np.float32)).cuda() * 2
    want = ops.qgemm.matmul(x, w)
    ms = (1, 7, 300, 4096)
    for m in ms:
        assert torch.equal(prompt_rows(ops, x[:m], w), want[:m]), f"{type_name} M={m}"
    assert torch.equal(prompt_rows(ops, x[1000:1300], w), want[1000:1300]), "rows 1000..1299"
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(prompt_rows(ops, x[perm], w), want[perm]), "permuted"
    for t in HG_TUNINGS:
        monkeypatch.setattr(
            ops, "hgemm", HGemm(kernels, dataclasses.replace(t, min_rows=1), wgmma=False)
        )
        for m in ms:
            assert torch.equal(prompt_rows(ops, x[:m], w), want[:m]), f"{t}: M={m}"
    monkeypatch.setattr(linear_cuda, "SCRATCH_BYTES", 2 * k * 41)
    for m in ms:
        assert torch.equal(prompt_rows(ops, x[:m], w), want[:m]), f"41-row tiles: M={m}"


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16"])
def test_split_readers_are_gguf_bitwise(ops, type_name: str) -> None:
    """QGemm.dequantize reads W as the prompt GEMMs do (gguf_split.cuh's raw-bits readers, their
    values formed by byte permutes since 2026-12-07): each value rounded to f16 is gguf-py's,
    rounded to f16. A block's scale times its small integer is exact in f32, so the one FFMA
    or FMUL rounds as numpy's operations do."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(90 + TYPES.index(type_name))
    n, k = 300, 1024
    w, raw = make_weight(type_name, n, k, rng, "cuda")
    w16 = torch.empty(n, k, dtype=torch.float16, device="cuda")
    ops.qgemm.dequantize(w, 0, n, w16)
    ref = dequantize(raw.reshape(n, -1), GGMLQuantizationType[type_name]).reshape(n, k)
    want = torch.from_numpy(ref.astype(np.float32)).half()
    bad = (w16.cpu().view(torch.int16) != want.view(torch.int16)).nonzero()
    assert len(bad) == 0, f"{type_name}: {len(bad)} values differ, first at {bad[0].tolist()}"


@pytest.mark.gpu
def test_hgemm_direct(kernels, ops) -> None:
    """HGemm.matmul on f16 operands == the float64 product of the same f16 values within fp32
    accumulation (ACC_TOL), into a column slice of a wider output (ldy != n, odd offset: the
    other columns untouched), M and n not multiples of the tiles; and == QGemm.matmul of the
    QGemm.dequantize'd rows' weight, bitwise; bad operands are a ValueError."""
    rng = np.random.default_rng(80)
    w, _ = make_weight("Q4_K", 200, 512, rng, "cuda")
    w16 = torch.empty(200, 512, dtype=torch.float16, device="cuda")
    ops.qgemm.dequantize(w, 0, 200, w16)
    x = torch.from_numpy(rng.standard_normal((333, 512), dtype=np.float32)).cuda()
    wide = torch.full((333, 203), float("nan"), device="cuda")
    hg = HGemm(kernels, HG_TUNINGS[2], wgmma=False)
    y = hg.matmul(x.half(), w16, wide[:, 1:201])
    torch.cuda.synchronize()
    assert wide[:, 0].isnan().all() and wide[:, 201:].isnan().all(), "wrote outside out"
    ref = x.half().double() @ w16.double().T
    scale = x.double().abs() @ w16.double().abs().T
    assert bound_error(y, ref.cpu(), scale.cpu()) <= ACC_TOL
    assert torch.equal(y, ops.qgemm.matmul(x, w)), "hgemm of dequantize != qgemm"
    part = torch.empty(50, 512, dtype=torch.float16, device="cuda")
    ops.qgemm.dequantize(w, 150, 50, part)
    assert torch.equal(part, w16[150:]), "dequantize of rows 150..199"
    with pytest.raises(ValueError, match="hgemm"):
        hg.matmul(x.half(), w16, torch.empty(333, 199, device="cuda"))
    with pytest.raises(ValueError, match="w16"):
        hg.matmul(x.half(), w16.float(), wide[:, 1:201])


# ---- GPU: grouped MoE ----------------------------------------------------------------------------


GROUPED_CASES = [  # (gate/up format, down format, gate and up fused in one tensor)
    ("Q4_K", "Q8_0", False),
    ("Q6_K", "Q5_0", True),
    ("Q5_0", "Q4_K", False),
    ("F16", "BF16", True),
]


def grouped_case(gate_type: str, down_type: str, fused: bool):  # type: ignore[no-untyped-def]
    """The GROUPED_CASES layer: 300 tokens x 4 of 16 experts, skewed (expert 11 on every token,
    12..15 on none), d 256, ff 320 (not a multiple of the 128-column tile; 512 where the down
    projection is a K-quant, whose rows are whole 256-value blocks). Returns the kernels'
    arguments on the GPU (x, weights, experts, routing weights) and the float64 reference with
    its error scale."""
    d, ff = 256, (512 if down_type.endswith("_K") else 320)
    case = make_case(gate_type, down_type, 16, d, ff, fused=fused, seed=21, device="cuda")
    rng = np.random.default_rng(21)
    x = torch.from_numpy(rng.standard_normal((300, d), dtype=np.float32))
    experts, weights = skewed_routing(300, 4, 16, rng)
    ref, scale = reference_moe(case, x, experts, weights)
    return (x.cuda(), case.w, experts.cuda(), weights.cuda()), ref, scale


@pytest.mark.gpu
@pytest.mark.parametrize(("gate_type", "down_type", "fused"), GROUPED_CASES)
def test_grouped_moe_matches_reference(
    cuda_ops, monkeypatch: pytest.MonkeyPatch, gate_type: str, down_type: str, fused: bool
) -> None:
    """The grouped path on ``grouped_case``'s layer against the float64 reference, and against
    the bucketed cuBLAS path."""
    args, ref, scale = grouped_case(gate_type, down_type, fused)
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
@pytest.mark.parametrize("tuning", range(len(GROUPED_TUNINGS)))
def test_grouped_moe_tilings_are_bitwise_the_default(cuda_ops, tuning: int) -> None:
    """The grouped kernels under each tiling the bench compares give the default's bits (300
    skewed tokens; gate/up Q4_K, down Q5_0 as a Q4_K_M file's 640-wide experts have them)."""
    d, ff, e, kk = 256, 320, 16, 4
    case = make_case("Q4_K", "Q5_0", e, d, ff, fused=False, seed=23, device="cuda")
    rng = np.random.default_rng(23)
    x = torch.from_numpy(rng.standard_normal((300, d), dtype=np.float32)).cuda()
    experts, weights = (t.cuda() for t in skewed_routing(300, kk, e, rng))
    qgemm, grouped = cuda_ops.linear.qgemm, cuda_ops.moe.prefill.grouped
    want = grouped(x, case.w, experts, weights)
    default, wgmma = qgemm.grouped, qgemm.wgmma
    try:  # the tilings are the mma.sync kernels' (want: the default, wgmma on sm_90)
        qgemm.grouped, qgemm.wgmma = GROUPED_TUNINGS[tuning], False
        got = grouped(x, case.w, experts, weights)
    finally:
        qgemm.grouped, qgemm.wgmma = default, wgmma
    assert torch.equal(got, want), f"tiling {GROUPED_TUNINGS[tuning]} differs from the default"


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

DENSE_SHAPES = [(2560, 2560), (10240, 2560), (2560, 10240)]  # (n_out, k) at M = 4096
HG_SWEEP = (
    "128,256,32,3,2,4",
    "128,256,64,3,2,4",
    "256,128,32,4,4,2",
    "128,128,32,4,2,4,2",
    "128,128,64,3,2,4,2",
    "128,256,32,4,2,4,1,16",
)


def time_dense(lin, w, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Print the dense prompt GEMM's paths on x [4096, k] and W [n, k] (test_dense_gemm_timing)."""
    from mgserve.cuda.ops.f16_products import f16_mm

    (m, k), n = x.shape, w.rows
    x16, w16 = x.half(), DenseWeights()(w).half()
    out = torch.empty(m, n, device="cuda")
    flop = 2 * m * n * k
    times = {
        "default (dequant + hgemm)": gpu_ms(lambda: lin.matmul(x, w), 20),
        "hgemm alone": gpu_ms(lambda: lin.hgemm.matmul(x16, w16, out), 20),
        "qgemm (per-CTA decode)": gpu_ms(lambda: lin.qgemm.matmul(x, w), 20),
        "cuBLAS alone": gpu_ms(lambda: f16_mm(x16, w16), 20),
    }
    monkeypatch.setattr(lin, "cublas_prefill", True)
    times["dequant + cuBLAS"] = gpu_ms(lambda: lin.matmul(x, w), 20)
    monkeypatch.setattr(lin, "cublas_prefill", False)
    hg = lin.hgemm
    tiles = f"hgemm_wgmma.cu {hg.wgmma_tiles(n)}" if hg.wgmma else f"hgemm.cu {hg.tuning}"
    kind = "qgemm_wgmma.cu" if lin.qgemm.on_wgmma(w.type_name) else "qgemm.cu"
    print(f"dense {w.type_name} M={m} n_out={n} k={k} ({tiles}; per-CTA decode: {kind}):")
    for label, ms in times.items():
        print(f"  {label:28s} {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s")
    if os.environ.get("MGSERVE_HGEMM_SWEEP") and w.type_name == "Q4_K":
        for spec in HG_SWEEP:
            alt = HGemm(lin.kernels, HGemmTuning.parse(spec), wgmma=False)
            ms = gpu_ms(lambda alt=alt: alt.matmul(x16, w16, out), 20)
            print(f"  hgemm tiles {spec:24s} {ms:7.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s")


@pytest.mark.gpu
def test_dense_gemm_timing(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed, per dense shape at M = 4096 (Q4_K; Q5_0, Q6_K and Q8_0 at 2560 x 2560):
    LinearCuda.matmul's default path (W decoded once, then hgemm.cu, or hgemm_wgmma.cu on sm_90:
    what a prompt step runs), that GEMM alone on the f16 W, the per-CTA-decode qgemm.cu (or its
    wgmma twin), the dequant + cuBLAS path
    (``cublas_prefill``) and cuBLAS alone on the f16 W. With MGSERVE_HGEMM_SWEEP=1, hgemm.cu
    alone under the other tunings of HG_SWEEP."""
    lin = cuda_ops.linear
    rng = np.random.default_rng(24)
    x = torch.from_numpy(rng.standard_normal((4096, 10240), dtype=np.float32)).cuda()
    cases = [("Q4_K", n, k) for n, k in DENSE_SHAPES]
    cases += [(t, 2560, 2560) for t in ("Q5_0", "Q6_K", "Q8_0")]
    for t, n, k in cases:
        w, _ = make_weight(t, n, k, rng, "cuda")
        time_dense(lin, w, x[:, :k].contiguous(), monkeypatch)
    if os.environ.get("MGSERVE_QGEMM_SWEEP"):  # other qgemm.cu tilings on a Q4_K weight
        w, _ = make_weight("Q4_K", 2560, 2560, rng, "cuda")
        x16 = x[:, :2560].half()
        for spec in ("64,128,32,2,4", "128,64,32,4,2", "64,64,64,2,2", "128,128,16,2,4,2"):
            alt = QGemm(lin.kernels, tuning=QGemmTuning.parse(spec), wgmma=False)
            ms = gpu_ms(lambda alt=alt, w=w: alt.matmul(x16, w))
            print(f"qgemm Q4_K 4096x2560x2560 tiles {spec}: {ms:.3f} ms")


@pytest.mark.gpu
def test_grouped_moe_timing(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed: the qwen4exp MoE layer (4096 x top-10 of 256, Q4_K gate/up, Q5_0 down), the
    grouped path (qgemm.cu, or qgemm_wgmma.cu on sm_90) vs the bucketed cuBLAS path."""
    from tests.cuda.test_moe import target_case

    rng = np.random.default_rng(25)
    x = torch.from_numpy(rng.standard_normal((4096, 2560), dtype=np.float32)).cuda()
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
