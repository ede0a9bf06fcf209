"""HCTorch (the PyTorch twin of kernels/hc.cu) against ``reference.hyper_connections`` on the CPU
(runs in CI): the mix, the head's mix (no inject) and the combine are bitwise the reference's on
weights dequantized by the reference path; the fused combine + mix equals the two calls; a
token's results do not depend on the batch; bad shapes raise ValueError; and the kernels'
planning helpers (token groups, staged parts) behave as hc.cu assumes.

The helpers here (random HC weight sets of any format) are shared with the GPU tests in
test_hc.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from mgserve.core.reference import hyper_connections as hcref
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops.hc import DYNAMIC_SMEM, PART_ALIGN, HCTorch, HCTuning, down_part, token_group
from mgserve.cuda.ops.hc_cuda import HCCuda
from mgserve.cuda.weights import QuantWeight, upload_bytes
from tests.cuda.test_linear_matvec import random_tensor, reference_weight

EPS = 1e-6


def quant_weight(
    name: str, type_name: str, values: np.ndarray, device: str | torch.device = "cpu"
) -> tuple[QuantWeight, torch.Tensor]:
    """values [rows, k] float32 stored as ``type_name`` -> (QuantWeight on ``device``, the stored
    values as float32 [rows, k] through the reference path's dequantize, on the CPU). Formats
    gguf-py cannot quantize (the K- and i-quants) get valid random blocks instead (weights below
    ~1, seeded by the values): the tests compare against the stored values either way."""
    rows, k = values.shape
    try:
        raw = quants.quantize(values.astype(np.float32), GGMLQuantizationType[type_name])
    except NotImplementedError:
        rng = np.random.default_rng(int(np.abs(values).sum() * 1e3) % 2**32)
        raw = random_tensor(type_name, rows, k, rng)
    w = upload_bytes(name, type_name, (k, rows), raw, device)
    return w, reference_weight(type_name, rows, k, np.ascontiguousarray(raw))


class HCCase(NamedTuple):
    """One random HC weight set with its reference (float32 CPU) weights."""

    norm: torch.Tensor  # [hc, d] float32 on the weights' device
    down: QuantWeight
    up: QuantWeight
    inject: QuantWeight | None
    ref: hcref.HCWeights  # float32 CPU

    @property
    def hc(self) -> int:
        return self.norm.shape[0]

    @property
    def d(self) -> int:
        return self.norm.shape[1]


def make_case(
    hc: int,
    d: int,
    r: int,
    types: tuple[str, str, str] | str,  # down, up, inject formats (or one for all)
    seed: int,
    head: bool = False,
    device: str | torch.device = "cpu",
) -> HCCase:
    """Weights scaled so pre-activations are O(1) (no saturated gates: every product matters)."""
    if isinstance(types, str):
        types = (types, types, types)
    rng = np.random.default_rng(seed)
    k = hc * d
    norm = (1.0 + 0.1 * rng.standard_normal((hc, d))).astype(np.float32)
    down, down_ref = quant_weight(
        "down", types[0], rng.standard_normal((r, k), dtype=np.float32) * k**-0.5 * 2, device
    )
    up, up_ref = quant_weight(
        "up", types[1], rng.standard_normal((k, r), dtype=np.float32) * r**-0.5 * 3, device
    )
    inject, inj_ref = None, None
    if not head:
        inject, inj_ref = quant_weight(
            "inject", types[2], rng.standard_normal((hc, k), dtype=np.float32) * k**-0.5 * 4, device
        )
    norm_t = torch.from_numpy(norm)
    ref = hcref.HCWeights(norm=norm_t, down=down_ref, up=up_ref, inject=inj_ref)
    return HCCase(norm_t.to(device), down, up, inject, ref)


def make_streams(n: int, hc: int, d: int, seed: int) -> torch.Tensor:
    """x [n, hc, d] float32 on the CPU, streams of different scales."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, hc, 1, generator=g) * 4 + 0.25
    return torch.randn(n, hc, d, generator=g) * scale


@pytest.fixture
def hct() -> HCTorch:
    """A fresh one per test: ``TorchBase.dense`` caches by storage address, which a later test's
    weights may reuse once an earlier test's are freed."""
    return HCTorch(DenseWeights())


def equal(name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert (got is None) == (want is None), f"{name}: {got is None=} but {want is None=}"
    if got is None or want is None:
        return
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    if not torch.equal(got, want):
        err = (got - want).abs().max().item()
        raise AssertionError(f"{name}: not bitwise equal, max abs diff {err:.3g}")


SHAPES = [  # (N, hc, d, r)
    (1, 4, 64, 32),
    (3, 4, 96, 64),
    (5, 3, 40, 32),  # hc * d = 120: not Q8_0 (32-value blocks)
    (2, 5, 64, 32),
]


@pytest.mark.parametrize("type_name", ["BF16", "F16", "F32", "Q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_mix_is_reference(hct: HCTorch, type_name: str, shape: tuple[int, int, int, int]) -> None:
    n, hc, d, r = shape
    if type_name == "Q8_0" and (hc * d) % 32:
        pytest.skip("Q8_0 rows are whole 32-value blocks")
    case = make_case(hc, d, r, type_name, seed=n * 31 + d)
    x = make_streams(n, hc, d, seed=d)
    mixed, inj = hct.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    want_mixed, want_inj = hcref.mix(x, case.ref, EPS)
    equal("mixed", mixed, want_mixed)
    equal("inject", inj, want_inj)


def test_head_mix_is_reference(hct: HCTorch) -> None:
    case = make_case(4, 64, 32, ("Q8_0", "BF16", "F32"), seed=3, head=True)
    x = make_streams(3, 4, 64, seed=4)
    mixed, inj = hct.mix(x, case.norm, case.down, case.up, None, EPS)
    want_mixed, want_inj = hcref.mix(x, case.ref, EPS)
    assert inj is None and want_inj is None
    equal("mixed", mixed, want_mixed)


def test_mix_with_takes_up_and_the_gated_mean_in_one_call() -> None:
    """``mix_with``'s ``up_gate_mix`` hook gets low [N, r] and xn [N, hc, d] and returns the
    block's input (what the device's fused up GEMM and gated mean compute); given the reference
    ops, the mix is the reference's, bitwise."""
    from functools import partial

    from mgserve.core.reference import ops

    case = make_case(4, 64, 32, "F32", seed=8)
    x = make_streams(5, 4, 64, seed=9)
    w = case.ref
    seen: list[tuple[int, ...]] = []

    def fused(low: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        seen.append((*low.shape, *xn.shape))
        return hcref.gated_mean(ops.linear(low, w.up).view(xn.shape), xn)

    assert w.inject is not None
    got = hcref.mix_with(
        x, w.norm, EPS, partial(ops.linear, w=w.down), partial(ops.linear, w=w.up),
        partial(ops.linear, w=w.inject), up_gate_mix=fused,
    )  # fmt: skip
    want = hcref.mix(x, w, EPS)
    assert seen == [(5, 32, 5, 4, 64)]
    equal("mixed", got[0], want[0])
    assert got[1] is not None and want[1] is not None
    equal("inject", got[1], want[1])


def test_combine_is_reference(hct: HCTorch) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 40, generator=g)
    out = torch.randn(3, 40, generator=g)
    inj = torch.rand(3, 4, generator=g) * 2
    equal("combine", hct.combine(x, out, inj), hcref.combine(x, out, inj))


def test_combine_mix_is_combine_then_mix(hct: HCTorch) -> None:
    case = make_case(4, 64, 32, "BF16", seed=6)
    g = torch.Generator().manual_seed(6)
    x = make_streams(3, 4, 64, seed=6)
    out = torch.randn(3, 64, generator=g)
    inj_prev = torch.rand(3, 4, generator=g) * 2
    x_new, mixed, inj = hct.combine_mix(
        x, out, inj_prev, case.norm, case.down, case.up, case.inject, EPS
    )
    want_x = hcref.combine(x, out, inj_prev)
    want_mixed, want_inj = hcref.mix(want_x, case.ref, EPS)
    equal("x", x_new, want_x)
    equal("mixed", mixed, want_mixed)
    equal("inject", inj, want_inj)


def test_batch_invariant(hct: HCTorch) -> None:
    """Each token's results are the same alone as in a batch of 7."""
    case = make_case(4, 64, 32, "Q8_0", seed=7)
    x = make_streams(7, 4, 64, seed=7)
    mixed, inj = hct.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    assert inj is not None
    for t in (0, 3, 6):
        m1, i1 = hct.mix(x[t : t + 1], case.norm, case.down, case.up, case.inject, EPS)
        equal(f"mixed of token {t}", m1, mixed[t : t + 1])
        equal(f"inject of token {t}", i1, inj[t : t + 1])


def test_rejects_bad_shapes(hct: HCTorch) -> None:
    case = make_case(4, 64, 32, "F32", seed=8)
    x = make_streams(2, 4, 64, seed=8)
    with pytest.raises(ValueError, match="expected \\[N, hc, d\\]"):
        hct.mix(x[0], case.norm, case.down, case.up, case.inject, EPS)
    with pytest.raises(ValueError, match="norm has shape"):
        hct.mix(x, case.norm[:3], case.down, case.up, case.inject, EPS)
    with pytest.raises(ValueError, match="hc \\* d"):
        hct.mix(x[:, :3], case.norm[:3], case.down, case.up, case.inject, EPS)
    with pytest.raises(ValueError, match="expected \\[hc \\* d, r\\]"):
        hct.mix(x, case.norm, case.down, case.down, case.inject, EPS)
    with pytest.raises(ValueError, match="expected \\[hc, hc \\* d\\]"):
        hct.mix(x, case.norm, case.down, case.up, case.down, EPS)
    with pytest.raises(ValueError, match="float32"):
        hct.mix(x.double(), case.norm, case.down, case.up, case.inject, EPS)
    with pytest.raises(ValueError, match="out has shape"):
        hct.combine(x, torch.zeros(2, 63), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="inject has shape"):
        hct.combine(x, torch.zeros(2, 64), torch.zeros(2, 3))


# -- the kernels' planning (pure Python: checked here, used by HCCuda) ---------------------------


def test_token_groups() -> None:
    assert [token_group(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 100)] == [1, 1, 2, 4, 4, 8, 8, 8, 8]


def test_down_part() -> None:
    """All of d when it fits; else a multiple of PART_ALIGN dividing d (a lane's runs keep their
    order: 256 values = 32 lanes x 8); None when no such part fits."""
    assert down_part(2560, 1) == 2560 and down_part(2560, 4) == 2560
    assert down_part(2560, 8) == 1280  # 8 x 2560 floats = 80 KB > 46 KB
    for d in (2560, 4096, 5120, 7168):
        for nt in (1, 2, 4, 8):
            part = down_part(d, nt)
            assert part is not None and d % part == 0 and nt * part * 4 <= DYNAMIC_SMEM
            assert part == d or part % PART_ALIGN == 0
    assert down_part(1800, 8) is None  # 57.6 KB, and 1800 has no multiple-of-256 divisor


def test_tuning_defines() -> None:
    t = HCTuning()
    defs = dict(t.defines("Q8_0"))
    assert defs["HC_TYPE"] == "Q8_0" and defs["DOWN_ROWS"] == "0x1112"
    assert dict(HCTuning(down_batch=(15, 10, 2, 1)).defines("BF16"))["DOWN_BATCH"] == "0xFA21"
    assert t.down_rows_per_cta(8) == t.down_warps * t.down_rows[3]
    assert t.up_cols_per_cta(2) == t.up_warps * t.up_cols[1]
    with pytest.raises(ValueError, match="down_rows"):
        HCTuning(down_rows=(1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="up_batch"):
        HCTuning(up_batch=(16, 1, 1, 1))
    with pytest.raises(ValueError, match="up_warps"):
        HCTuning(up_warps=0)


def test_kernels_apply_depends_on_shapes_and_formats_only() -> None:
    case = make_case(4, 64, 32, "BF16", seed=9)
    q4 = make_case(4, 64, 32, ("Q4_K", "Q5_0", "Q4_K"), seed=9)
    apply = HCCuda.kernels_apply
    assert apply(4, 2560, 320, (case.down, case.up, case.inject))
    assert apply(4, 2560, 320, (case.down, case.up, None))
    assert apply(4, 64, 32, (q4.down, q4.up, q4.inject))  # every GGUF format has a kernel
    assert not apply(4, 64, 32, (dataclasses.replace(q4.down, type_name="Q7_X"),))  # unknown
    assert not apply(4, 1800, 320, (case.down,))  # 8 tokens of d = 1800 cannot be staged
    assert not apply(4, 60, 32, (case.down,))  # d % 8
