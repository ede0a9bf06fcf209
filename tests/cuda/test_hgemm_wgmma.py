"""The prompt GEMM on warpgroup MMA (kernels/hgemm_wgmma.cu, ``HGemm.wgmma``; sm_90a).

CPU (CI): the tuning's validation and parsing, and the refusal on a GPU other than sm_90.
GPU (marked; an sm_90 GPU, else skipped):

- bitwise the same as hgemm.cu (mma.sync m16n8k16), the path it replaces, for M and n not
  multiples of the tiles, k of one 64-step to many and with a partial last step, under each
  tuning of WG_TUNINGS; and within fp32 accumulation of the float64 product of its f16 operands
  (ACC_TOL), so that an equal wrong answer from both cannot pass;
- into a column slice of a wider output (odd offset: scalar stores; the other columns
  untouched);
- through ``LinearCuda.matmul`` as a prompt step: rows bitwise equal to qgemm.cu's (the per-CTA
  decode path small prompts take) at M 1, 7, 300 and 4096, i.e. batch invariance holds with it;
- printed timings at qwen4exp's shapes (M = 4096), hgemm.cu against each tuning.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mgserve.cuda.ops.hgemm import HGemm
from mgserve.cuda.ops.qgemm import QGemm
from mgserve.cuda.ops.wgmma import WgmmaTuning
from tests.cuda.test_moe_prefill import gpu_ms
from tests.cuda.test_moe_torch import bound_error, make_weight
from tests.cuda.test_qgemm import ACC_TOL, prompt_rows

WG_TUNINGS = [
    WgmmaTuning(),  # 128 x 256, 4 stages
    WgmmaTuning(128, 128, 5),
    WgmmaTuning(64, 128, 4, 1),  # one warpgroup, plain CTA order
    WgmmaTuning(64, 256, 5),
    WgmmaTuning(128, 128, 3),  # the fewest stages: copies one step ahead
    WgmmaTuning(64, 128, 8),  # the most
]
SHAPES = [  # (M, n, k)
    (300, 129, 520),  # k % 64 = 8: a partial last step
    (257, 300, 768),
    (1, 7, 64),
    (4096, 2560, 2560),
    (130, 513, 4104),
]


def test_tuning_validation() -> None:
    assert WgmmaTuning.parse("128,128,5") == WgmmaTuning(128, 128, 5)
    assert WgmmaTuning().threads == 256 and WgmmaTuning(64, 128, 4).threads == 128
    assert WgmmaTuning().smem_bytes == 4 * 384 * 128 + 1024
    for bad in ("128,256", "128,256,4,8,1", "a,b,c"):
        with pytest.raises(ValueError, match="expected BM,BN,STAGES"):
            WgmmaTuning.parse(bad)
    for args in ((96, 256, 4), (128, 64, 4), (128, 256, 2), (128, 256, 6), (128, 256, 4, 0)):
        with pytest.raises(ValueError, match="WgmmaTuning"):
            WgmmaTuning(*args)


def test_wgmma_needs_sm90() -> None:
    """HGemm.wgmma on a GPU without warpgroup MMA is refused by name, before any launch."""

    class NoWgmma:
        device = torch.device("cpu")
        wgmma = False

    hg = HGemm(NoWgmma())  # type: ignore[arg-type]
    assert not hg.wgmma  # the default follows the GPU
    hg.wgmma = True
    x = torch.zeros(2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="sm_90"):
        hg.matmul(x, x, torch.zeros(2, 2))


@pytest.fixture
def wg_kernels(kernels):  # type: ignore[no-untyped-def]
    if not kernels.wgmma:
        pytest.skip("warpgroup MMA needs an sm_90 GPU")
    return kernels


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).half()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).half()
    return x, w


@pytest.mark.gpu
def test_wgmma_bitwise_equals_mma_sync(wg_kernels) -> None:  # type: ignore[no-untyped-def]
    mma = HGemm(wg_kernels, wgmma=False)
    for i, (m, n, k) in enumerate(SHAPES):
        x, w = operands(m, n, k, i)
        want = mma.matmul(x, w, torch.empty(m, n, device="cuda"))
        ref = x.double() @ w.double().T
        scale = x.double().abs() @ w.double().abs().T
        for t in WG_TUNINGS:
            wg = HGemm(wg_kernels, wgmma_tuning=t, wgmma=True)
            got = wg.matmul(x, w, torch.full((m, n), float("nan"), device="cuda"))
            label = f"M={m} n={n} k={k} {t}"
            assert bound_error(got, ref.cpu(), scale.cpu()) <= ACC_TOL, label
            assert torch.equal(got, want), f"{label}: wgmma != mma.sync"


@pytest.mark.gpu
def test_wgmma_into_a_column_slice(wg_kernels) -> None:  # type: ignore[no-untyped-def]
    x, w = operands(333, 200, 512, 7)
    wide = torch.full((333, 203), float("nan"), device="cuda")
    wg = HGemm(wg_kernels, wgmma=True)
    y = wg.matmul(x, w, wide[:, 1:201])
    torch.cuda.synchronize()
    assert wide[:, 0].isnan().all() and wide[:, 201:].isnan().all(), "wrote outside out"
    mma = HGemm(wg_kernels, wgmma=False)
    assert torch.equal(y, mma.matmul(x, w, torch.empty(333, 200, device="cuda")))


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "BF16"])
def test_prompt_rows_invariant_with_wgmma(
    wg_kernels, ops, monkeypatch: pytest.MonkeyPatch, type_name: str
) -> None:  # type: ignore[no-untyped-def]
    """LinearCuda.matmul as a prompt step with ``hgemm.wgmma`` on: M 300 and 4096 take the
    dequantize + wgmma path, M 1 and 7 qgemm.cu; every row equals qgemm.cu's on all 4096."""
    rng = np.random.default_rng(90)
    w, _ = make_weight(type_name, 300, 768, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((4096, 768), dtype=np.float32)).cuda() * 2
    want = QGemm(wg_kernels, wgmma=False).matmul(x, w)  # qgemm.cu: mma.sync
    monkeypatch.setattr(ops, "hgemm", HGemm(wg_kernels, ops.hgemm.tuning, wgmma=True))
    monkeypatch.setattr(ops.qgemm, "wgmma", True)
    for m in (1, 7, 300, 4096):
        assert torch.equal(prompt_rows(ops, x[:m], w), want[:m]), f"{type_name} M={m}"
    assert torch.equal(prompt_rows(ops, x[1000:1300], w), want[1000:1300]), "rows 1000..1299"


@pytest.mark.gpu
def test_wgmma_timing(wg_kernels) -> None:  # type: ignore[no-untyped-def]
    """Printed (not a bench row): hgemm.cu and each tuning at M = 4096, qwen4exp's shapes."""
    for n, k in ((2560, 2560), (10240, 2560), (2560, 10240), (12288, 2560)):
        x, w = operands(4096, n, k, 1)
        out = torch.empty(4096, n, device="cuda")
        flop = 2 * 4096 * n * k
        mma = HGemm(wg_kernels, wgmma=False)
        ms = gpu_ms(lambda g=mma, x=x, w=w, o=out: g.matmul(x, w, o), 20)
        print(f"\nM=4096 n={n} k={k}: mma.sync {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
        for t in [*WG_TUNINGS, dataclasses.replace(WG_TUNINGS[0], stages=3)]:
            wg = HGemm(wg_kernels, wgmma_tuning=t, wgmma=True)
            ms = gpu_ms(lambda g=wg, x=x, w=w, o=out: g.matmul(x, w, o), 20)
            print(f"  wgmma {t}: {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
