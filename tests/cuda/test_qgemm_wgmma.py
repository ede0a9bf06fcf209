"""qgemm.cu's GEMMs on warpgroup MMA (kernels/qgemm_wgmma.cu, ``QGemm.wgmma``; sm_90a).

CPU (CI): the tuning's validation and parsing; a grouped launch refuses tiles made for other
kernels. GPU (marked; an sm_90 GPU, else skipped), for every format:

- the dense GEMM against the float64 products (test_qgemm's ``check_dense``), M and n_out not
  multiples of the tiles, k with partial last steps; bitwise equal to hgemm_wgmma.cu on the
  same W decoded once (the pair a prompt takes by its length), and to qgemm.cu (mma.sync);
- batch invariance: rows alone, in other batches and permuted, bitwise;
- the grouped MoE path with it on: against the float64 reference, batch-invariant, and bitwise
  the mma.sync kernels' result;
- printed timings of a 4096-token chunk's MoE products at qwen4exp's shapes, on and off.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mgserve.cuda.ops.grouped_rows import GroupedRows
from mgserve.cuda.ops.hgemm import HGemm
from mgserve.cuda.ops.qgemm import QGemm
from mgserve.cuda.ops.wgmma import WGMMA_FORMATS, QWgmmaTuning
from tests.cuda.test_moe_prefill import gpu_ms
from tests.cuda.test_moe_torch import RTOL_F16, bound_error, make_case, make_weight
from tests.cuda.test_qgemm import GROUPED_CASES, TYPES, check_dense, grouped_case, k_values

QW_TUNINGS = [
    QWgmmaTuning(),  # Q4_K / Q5_0 / Q8_0's W by half row-steps (the default), the others by runs
    QWgmmaTuning(rows=False),  # every format's W by 8-value runs
    QWgmmaTuning(64, 128, 1),  # half row-steps: two a thread
    QWgmmaTuning(128, 256, 1),
    QWgmmaTuning(64, 256),  # one warpgroup, X read by half as many column tiles
    QWgmmaTuning(192, 128, 1),  # 384 threads: the runs, some threads' last W run idle
    QWgmmaTuning(256, 128, 1),
    QWgmmaTuning(128, 128, 2, 3),  # three buffers: X and W two steps ahead
    QWgmmaTuning(64, 256, 2, 3),
    QWgmmaTuning(256, 128, 1, 3),  # W decoded once for 256 rows, loads two steps ahead
    QWgmmaTuning(decode=1, rows=False),  # W's values by shifts and masks (SPLIT_DECODE 1)
    QWgmmaTuning(64, 128, 1, rows=False),
    QWgmmaTuning(128, 128, 2, 3, rows=False),
]


def test_tuning_validation() -> None:
    assert QWgmmaTuning.parse("64,256") == QWgmmaTuning(64, 256)
    assert QWgmmaTuning().threads == 256 and QWgmmaTuning().smem_bytes == 2 * 256 * 128 + 1024
    assert dict(QWgmmaTuning().defines("Q6_K"))["QG_TYPE"] == "Q6_K"
    assert QWgmmaTuning.parse("128,128,2,3").smem_bytes == 3 * 256 * 128 + 1024
    assert dict(QWgmmaTuning(stages=3).defines("Q4_K"))["QW_STAGES"] == "3"
    assert "QW_STAGES" not in dict(QWgmmaTuning().defines("Q4_K"))  # the default's cache key
    assert QWgmmaTuning(128, 128, 2, 3).with_rows(64) == QWgmmaTuning(64, 128, 2, 3)
    assert QWgmmaTuning(64, 256, 2, 3).with_rows(256) == QWgmmaTuning(256, 128, 1, 3)
    assert dict(QWgmmaTuning.parse("128,128,2,2,1").defines("Q4_K"))["SPLIT_DECODE"] == "1"
    assert QWgmmaTuning(decode=1).with_rows(256) == QWgmmaTuning(256, 128, 1, 2, 1)
    assert QWgmmaTuning.parse("128,128,2,2,2,0") == QWgmmaTuning(rows=False)
    assert QWgmmaTuning.parse("128,128") == QWgmmaTuning()  # half row-steps by default
    assert "QW_ROWS" not in dict(QWgmmaTuning(decode=1).defines("Q4_K"))  # decode 1: the runs
    assert "QW_ROWS" not in dict(QWgmmaTuning(192, 128, 1).defines("Q4_K"))  # 256 halves, 384 t
    for bad in ("128", "1,2,3,4,5,6,7", "x,y"):
        with pytest.raises(ValueError, match="expected BM,BN"):
            QWgmmaTuning.parse(bad)
    assert QWgmmaTuning.parse("128,128,2,2,2,1") == QWgmmaTuning(rows=True)
    with pytest.raises(ValueError, match="ROWS is 0 or 1"):
        QWgmmaTuning.parse("128,128,2,2,2,3")
    assert dict(QWgmmaTuning().defines("Q4_K"))["QW_ROWS"] == "1"
    assert "QW_ROWS" not in dict(QWgmmaTuning(rows=False).defines("Q4_K"))
    assert "QW_ROWS" not in dict(QWgmmaTuning(rows=True).defines("Q6_K"))  # no reader for it
    assert QWgmmaTuning(rows=True).with_rows(64) == QWgmmaTuning(64, 128, 2, rows=True)
    assert QWgmmaTuning.parse("192,128,1").threads == 384
    bad_args = ((96, 128), (128, 64), (128, 128, 3), (320, 128, 1), (128, 128, 2, 4))
    for args in (*bad_args, (128, 128, 2, 2, 3)):
        with pytest.raises(ValueError, match="QWgmmaTuning"):
            QWgmmaTuning(*args)
    with pytest.raises(ValueError, match="do not fit 2 CTAs of 384 threads"):
        QWgmmaTuning(192, 128, 2)  # 64 accumulators a thread beside the tile's addressing


class FakeKernels:
    """Kernels on the CPU that record which kernel each launch names (outputs untouched)."""

    device = torch.device("cpu")
    wgmma = True

    def __init__(self) -> None:
        self.launches: list[str] = []

    def kernel(self, source: str, name: str, *args: object, **kw: object) -> str:
        return f"{source}:{name}"

    def launch(self, kernel: str, *args: object, **kw: object) -> None:
        self.launches.append(kernel)


def test_grouped_rows_must_match_the_kernels() -> None:
    """GroupedRows of another tile height would index tiles the kernel does not have."""
    q = QGemm(FakeKernels(), wgmma=False)  # type: ignore[arg-type]
    rows = GroupedRows(torch.tensor([0, 0, 1]), 2, 64)
    h = torch.zeros(3, 8, dtype=torch.float16)
    gate = SimpleNamespace(type_name="Q4_K")
    with pytest.raises(ValueError, match="tiles of 64 rows for Q4_K kernels of 128"):
        q.gate_up(gate, 0, 8, h, torch.zeros(3, dtype=torch.int32), rows, h)  # type: ignore[arg-type]
    q.grouped_wgmma, q.wgmma = QWgmmaTuning(64, 128), True
    assert (q.grouped_bm("Q4_K"), q.grouped_bm("Q5_K")) == (64, 128)  # Q5_K: qgemm.cu's tiles
    assert q.grouped_bm("Q4_K", "Q5_K") == 128  # a layer of both kinds: qgemm.cu's rows
    with pytest.raises(ValueError, match="tiles of 64 rows for Q5_K kernels of 128"):
        q.down(SimpleNamespace(type_name="Q5_K"), h, rows, torch.zeros(3, 8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="QWgmmaTuning: bm 96"):  # no wgmma kernel of 96 rows
        rows = GroupedRows(torch.tensor([0, 0, 1]), 2, 96)
        q.down(gate, h, rows, torch.zeros(3, 8))  # type: ignore[arg-type]


def test_wgmma_tiles_follow_the_rows() -> None:
    """The wgmma MoE kernels run on tiles of the GroupedRows' height: ``grouped_wgmma``'s own,
    or, in a layer whose other format takes qgemm.cu (whose rows the layer then uses), that
    tuning's shape on qgemm.cu's rows."""
    kernels = FakeKernels()
    seen: list[object] = []
    kernels.kernel = lambda source, name, defines, **kw: seen.append(dict(defines)) or name  # type: ignore[method-assign]
    q = QGemm(kernels, wgmma=True)  # type: ignore[arg-type]
    q.grouped_wgmma = QWgmmaTuning(192, 128, 1)
    gate = SimpleNamespace(type_name="Q4_K", data=torch.zeros(1), k=256)
    h = torch.zeros(3, 8, dtype=torch.float16)
    tok = torch.zeros(3, dtype=torch.int32)
    for layer, bm in ((("Q4_K", "Q6_K"), 192), (("Q4_K", "Q5_K"), 128)):
        rows = GroupedRows(torch.tensor([0, 0, 1]), 2, q.grouped_bm(*layer))
        q.gate_up(gate, 0, 8, h, tok, rows, h)  # type: ignore[arg-type]
        assert (seen[-1]["QW_BM"], seen[-1]["QW_MIN_CTAS"]) == (str(bm), "1" if bm > 128 else "2")
    q.grouped_wgmma = QWgmmaTuning(64, 256)  # 128 rows x 256 columns fit one CTA an SM only
    rows = GroupedRows(torch.tensor([0, 0, 1]), 2, q.grouped_bm("Q4_K", "Q5_K"))
    q.down(gate, h, rows, torch.zeros(3, 8))  # type: ignore[arg-type]
    assert [seen[-1][k] for k in ("QW_BM", "QW_BN", "QW_MIN_CTAS")] == ["128", "256", "1"]


def test_tiles_on_other_rows() -> None:
    """``with_rows``: a tiling's columns on tiles of other rows where the registers allow, two CTAs
    an SM where they can; 128 columns where nothing else fits; no kernel of 96 rows."""
    assert QWgmmaTuning(192, 128, 1).with_rows(128) == QWgmmaTuning(128, 128, 2)
    assert QWgmmaTuning(64, 256).with_rows(128) == QWgmmaTuning(128, 256, 1)
    assert QWgmmaTuning().with_rows(256) == QWgmmaTuning(256, 128, 1)
    assert QWgmmaTuning(128, 256, 1).with_rows(256) == QWgmmaTuning(256, 128, 1)  # 512 threads
    with pytest.raises(ValueError, match="bm 96"):
        QWgmmaTuning().with_rows(96)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "IQ4_XS", "BF16"])
def test_formats_take_the_wgmma_kernels_they_have(type_name: str) -> None:
    """With ``wgmma`` on, a format of WGMMA_FORMATS launches qgemm_wgmma.cu's kernel and another
    qgemm.cu's; off, every format launches qgemm.cu's."""
    from mgserve.cuda.weights import FORMATS, QuantWeight, row_bytes

    k = FORMATS[type_name].block * 2
    w = QuantWeight("w", type_name, (k, 4), torch.zeros(4, row_bytes("w", type_name, k)).byte())
    x = torch.zeros(3, k)
    for on in (True, False):
        kernels = FakeKernels()
        QGemm(kernels, wgmma=on).matmul(x, w)  # type: ignore[arg-type]
        wg = on and type_name in WGMMA_FORMATS
        assert kernels.launches == ["qgemm_wgmma.cu:qgemm_wg" if wg else "qgemm.cu:qgemm"]


def test_a_layer_of_mixed_formats_takes_both_kinds_of_kernels() -> None:
    """A MoE layer whose gate/up format has wgmma kernels and whose down format has not (Q4_K /
    Q5_K, as a Q5_K_M file might mix them): gate_up on qgemm_wgmma.cu, down on qgemm.cu, one
    GroupedRows for both (the two kernels' default tiles have the same rows)."""
    from mgserve.cuda.weights import QuantWeight, row_bytes

    kernels = FakeKernels()
    q = QGemm(kernels, wgmma=True)  # type: ignore[arg-type]
    d, ff, e = 256, 256, 2
    gate = QuantWeight("g", "Q4_K", (d, ff * e), torch.zeros(ff * e, row_bytes("g", "Q4_K", d)))
    down = QuantWeight("dn", "Q5_K", (ff, d * e), torch.zeros(d * e, row_bytes("dn", "Q5_K", ff)))
    assert q.grouped_bm("Q4_K") == q.grouped_bm("Q5_K")
    rows = GroupedRows(torch.tensor([0, 0, 1]), e, q.grouped_bm("Q4_K"))
    h = torch.zeros(3, ff, dtype=torch.float16)
    q.gate_up(gate, 0, ff, torch.zeros(3, d), torch.zeros(3, dtype=torch.int32), rows, h)
    q.down(down, h, rows, torch.zeros(3, d))
    assert kernels.launches == ["qgemm_wgmma.cu:qgemm_gate_up_wg", "qgemm.cu:qgemm_down"]


@pytest.fixture
def wg_ops(kernels, ops):  # type: ignore[no-untyped-def]
    if not kernels.wgmma:
        pytest.skip("warpgroup MMA needs an sm_90 GPU")
    return ops


def wg_qgemm(kernels, tuning: QWgmmaTuning | None = None) -> QGemm:  # type: ignore[no-untyped-def]
    q = QGemm(kernels, wgmma=True)
    q.wgmma_tuning = tuning or QWgmmaTuning()
    return q


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(WGMMA_FORMATS))
def test_dense_matches_reference_and_the_other_paths(kernels, wg_ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(100 + TYPES.index(type_name))
    hg = HGemm(kernels, wgmma=True)
    mma = QGemm(kernels, wgmma=False)
    for k in k_values(type_name):
        for m, n_out in ((9, 200), (100, 7), (300, 129), (1000, 300)):
            w, _ = make_weight(type_name, n_out, k, rng, "cuda")
            x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).cuda()
            label = f"{type_name} M={m} n_out={n_out} k={k}"
            for t in QW_TUNINGS:
                y = check_dense(wg_qgemm(kernels, t).matmul, w, x, f"{label} {t}")
                w16 = torch.empty(n_out, k, dtype=torch.float16, device="cuda")
                wg_ops.qgemm.dequantize(w, 0, n_out, w16)
                out = torch.empty(m, n_out, device="cuda")
                assert torch.equal(y, hg.matmul(x.half(), w16, out)), f"{label}: != hgemm_wg"
                assert torch.equal(y, mma.matmul(x, w)), f"{label}: != mma.sync"


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "BF16"])
def test_dense_batch_invariant(kernels, wg_ops, type_name: str) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(110 + TYPES.index(type_name))
    k = k_values(type_name)[-1]
    w, _ = make_weight(type_name, 200, k, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((4096, k), dtype=np.float32)).cuda() * 2
    q = wg_qgemm(kernels)
    full = q.matmul(x, w)
    for rows in (slice(5, 6), slice(0, 9), slice(100, 117), slice(4032, 4096), slice(7, 107)):
        assert torch.equal(q.matmul(x[rows], w), full[rows]), f"{type_name} rows {rows}"
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(q.matmul(x[perm], w), full[perm]), f"{type_name} permuted"


@pytest.fixture
def moe_wgmma(wg_ops, cuda_ops):  # type: ignore[no-untyped-def]
    """cuda_ops with the grouped kernels on wgmma for the test, put back after."""
    qgemm = cuda_ops.linear.qgemm
    was, qgemm.wgmma = qgemm.wgmma, True
    yield cuda_ops
    qgemm.wgmma, qgemm.wgmma_tuning, qgemm.grouped_wgmma = was, QWgmmaTuning(), QWgmmaTuning()


@pytest.mark.gpu
@pytest.mark.parametrize(("gate_type", "down_type", "fused"), GROUPED_CASES)
def test_grouped_moe(moe_wgmma, gate_type: str, down_type: str, fused: bool) -> None:  # type: ignore[no-untyped-def]
    """test_qgemm's grouped case (300 skewed tokens x 4 of 16 experts, ff not a multiple of the
    tile) with wgmma: within RTOL_F16 of the float64 reference, bitwise the mma.sync kernels'
    result, and 20 tokens' rows bitwise the same beside 280 others."""
    args, ref, scale = grouped_case(gate_type, down_type, fused)
    grouped = moe_wgmma.moe.prefill.grouped
    y = grouped(*args)
    err = bound_error(y.cpu(), ref, scale)
    assert err <= RTOL_F16, f"{gate_type}/{down_type}: error {err:.2e}"
    alone = grouped(args[0][:20], args[1], args[2][:20], args[3][:20])
    assert torch.equal(alone, y[:20]), "20 tokens alone != beside 280 others"
    for t in QW_TUNINGS[1:]:  # every MoE tiling (on qgemm.cu's rows where a format has no wgmma)
        moe_wgmma.linear.qgemm.grouped_wgmma = t
        assert torch.equal(grouped(*args), y), f"{gate_type}/{down_type} on {t}"
    moe_wgmma.linear.qgemm.wgmma = False
    assert torch.equal(y, grouped(*args)), "wgmma != mma.sync"


@pytest.mark.gpu
def test_grouped_moe_timing(moe_wgmma) -> None:  # type: ignore[no-untyped-def]
    """Printed (not a bench row): grouped MoE products at qwen4exp's shapes and rows per expert
    (d 2560, ff 640, 8 experts a token; 1024 tokens on 64 experts: 128 rows an expert, as
    4096 tokens on 256), on and off."""
    d, ff, e, kk, n = 2560, 640, 64, 8, 1024
    case = make_case("Q4_K", "Q5_0", e, d, ff, fused=True, seed=5, device="cuda")
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((n, d), dtype=np.float32)).cuda()
    experts = torch.from_numpy(
        np.stack([rng.choice(e, kk, replace=False) for _ in range(n)])
    ).cuda()
    weights = torch.full((n, kk), 1.0 / kk, device="cuda")
    grouped = moe_wgmma.moe.prefill.grouped
    flop = 2 * n * kk * 3 * d * ff
    qgemm = moe_wgmma.linear.qgemm
    for on in (True, False, True):
        qgemm.wgmma = on
        ms = gpu_ms(lambda: grouped(x, case.w, experts, weights), 10)
        print(f"\ngrouped moe wgmma {on}: {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
    want = grouped(x, case.w, experts, weights)
    for t in QW_TUNINGS[1:]:
        qgemm.grouped_wgmma = t
        assert torch.equal(grouped(x, case.w, experts, weights), want), f"{t}: not the default's"
        ms = gpu_ms(lambda: grouped(x, case.w, experts, weights), 10)
        print(f"grouped moe wgmma {t}: {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")


@pytest.mark.gpu
@pytest.mark.parametrize("down_type", ["Q5_0", "Q8_0"])
def test_row_readers_at_qwen4exp_shapes(moe_wgmma, down_type: str) -> None:  # type: ignore[no-untyped-def]
    """The half row-step readers (``QWgmmaTuning.rows``) at qwen4exp's MoE shapes (a Q4_K gate /
    up fused as the converter writes it, a Q4_K_M file's down formats) and on dense products of
    their formats: bitwise the runs' reader; the grouped products' times printed side by side."""
    d, ff, e, kk, n = 2560, 640, 64, 8, 1024
    case = make_case("Q4_K", down_type, e, d, ff, fused=True, seed=7, device="cuda")
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((n, d), dtype=np.float32)).cuda()
    experts = torch.from_numpy(np.stack([rng.choice(e, kk, replace=False) for _ in range(n)]))
    weights = torch.full((n, kk), 1.0 / kk, device="cuda")
    grouped, qgemm = moe_wgmma.moe.prefill.grouped, moe_wgmma.linear.qgemm
    flop = 2 * n * kk * 3 * d * ff
    ys = {}
    for rows in (False, True, False):
        qgemm.grouped_wgmma = QWgmmaTuning(rows=rows)
        ys[rows] = grouped(x, case.w, experts.cuda(), weights)
        ms = gpu_ms(lambda: grouped(x, case.w, experts.cuda(), weights), 10)
        print(f"\nQ4_K/{down_type} grouped, rows {rows}: {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
    assert torch.equal(ys[True], ys[False]), f"Q4_K/{down_type}: rows != runs"
    for type_name, k in (("Q4_K", 2560), (down_type, 640)):
        w, _ = make_weight(type_name, 1000, k, rng, "cuda")
        xs = torch.from_numpy(rng.standard_normal((300, k), dtype=np.float32)).cuda()
        want = wg_qgemm(qgemm.kernels, QWgmmaTuning(rows=False)).matmul(xs, w)
        got = wg_qgemm(qgemm.kernels, QWgmmaTuning(rows=True)).matmul(xs, w)
        assert torch.equal(got, want), f"dense {type_name}: rows != runs"


@pytest.mark.gpu
def test_untried_row_readers(moe_wgmma, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The readers and wgmma formats written and host-tested but not yet run on a GPU
    (ROW_FORMATS_UNTRIED, WGMMA_FORMATS_UNTRIED: kept out until this passes), turned on here:
    dense products bitwise the runs' reader and qgemm.cu's mma.sync; grouped layers (a Q6_K and
    a Q5_K gate / up, a Q6_K / Q5_K / Q5_1 down) bitwise the runs' reader and mma.sync, with their
    errors against the float64 reference; the grouped times printed."""
    from mgserve.cuda.ops import qgemm as qgemm_module
    from mgserve.cuda.ops import wgmma

    monkeypatch.setattr(wgmma, "ROW_FORMATS", wgmma.ROW_FORMATS | wgmma.ROW_FORMATS_UNTRIED)
    formats = wgmma.WGMMA_FORMATS | wgmma.WGMMA_FORMATS_UNTRIED
    monkeypatch.setattr(qgemm_module, "WGMMA_FORMATS", formats)
    qgemm = moe_wgmma.linear.qgemm
    mma = QGemm(qgemm.kernels, wgmma=False)
    rng = np.random.default_rng(9)
    for type_name in sorted(wgmma.ROW_FORMATS_UNTRIED):
        for k in k_values(type_name):
            w, _ = make_weight(type_name, 300, k, rng, "cuda")
            x = torch.from_numpy(rng.standard_normal((129, k), dtype=np.float32)).cuda()
            want = wg_qgemm(qgemm.kernels, QWgmmaTuning(rows=False)).matmul(x, w)
            assert torch.equal(want, mma.matmul(x, w)), f"dense {type_name} k={k}: != mma.sync"
            for t in (  # a thread's items 1, 2 and 4, and three buffers
                QWgmmaTuning(),
                QWgmmaTuning(64, 128, 1),
                QWgmmaTuning(64, 256),
                QWgmmaTuning(128, 128, 2, 3),
            ):
                got = wg_qgemm(qgemm.kernels, t).matmul(x, w)
                assert torch.equal(got, want), f"dense {type_name} k={k} {t}: rows != runs"
    grouped = moe_wgmma.moe.prefill.grouped
    layers = (("Q6_K", "Q5_0"), ("Q5_K", "Q6_K"), ("Q4_K", "Q5_K"), ("Q5_K", "Q5_1"))
    for gate_type, down_type in layers:
        args, ref, scale = grouped_case(gate_type, down_type, True)
        ys = {}
        for rows in (False, True):
            qgemm.grouped_wgmma = QWgmmaTuning(rows=rows)
            ys[rows] = grouped(*args)
            ms = gpu_ms(lambda a=args: grouped(*a), 10)  # type: ignore[misc]
            print(f"\n{gate_type}/{down_type} grouped, rows {rows}: {ms:.3f} ms")
        label = f"grouped {gate_type}/{down_type}"
        assert torch.equal(ys[True], ys[False]), f"{label}: rows != runs"
        assert bound_error(ys[True].cpu(), ref, scale) <= RTOL_F16, label
        qgemm.wgmma = False
        assert torch.equal(grouped(*args), ys[True]), f"{label}: != mma.sync"
        qgemm.wgmma = True
