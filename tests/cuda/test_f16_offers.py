"""Prompt activations' f16 copies written by their producers (cuda/ops/f16_rows.py): the norm,
the gated norm, the hyper-connection mix's gated mean and the gated activations write each
output's f16 copy beside it, which the prompt GEMMs read instead of converting the output again;
and the prompt mix's combine and norm in one kernel (hc_prompt.py). Each copy is the
conversion's bits, the fused pass the two ops' bits, and whole prompts give the same logits with
fewer conversions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgserve.cuda.ops import f16_rows as f16_rows_module
from mgserve.cuda.ops.f16_rows import f16_rows
from tests.cuda.test_batch_invariance import _all_logits, _bench
from tests.cuda.test_device_models import _export, _tokens

pytestmark = pytest.mark.gpu

N = 37  # prompt rows (more than the decode kernels' 8: the GEMMs read them)


@pytest.fixture(autouse=True)
def copies_on(cuda_ops):  # type: ignore[no-untyped-def]
    """The producers' copies, the fused combine + norm and the fused up + gated mean on (the
    last is off by default: slower), restored after."""
    x16, hc = cuda_ops.linear.x16, cuda_ops.hc
    saved = x16.offers, hc.prompt_combine_norm, hc.prompt_up_gate
    x16.offers = hc.prompt_combine_norm = hc.prompt_up_gate = True
    yield
    x16.offers, hc.prompt_combine_norm, hc.prompt_up_gate = saved


def _offered(ops, y: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    got = ops.linear.x16.find(y)
    assert got is not None, "no f16 copy was offered"
    return got


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda") * 3.0


def test_norm_copies_are_the_conversion(cuda_ops) -> None:  # type: ignore[no-untyped-def]
    ops = cuda_ops
    ops.linear.x16.clear()
    x, w = _rand(N, 4, 64), _rand(4, 64)
    y = ops.norm.rms(x, w, 1e-6, f16=True)
    flat = y.reshape(N, 256)  # what the mix's down projection reads
    assert torch.equal(_offered(ops, flat), f16_rows(flat))
    assert ops.linear.x16.find(ops.norm.rms(x, w, 1e-6)) is None  # not asked for: none
    o, z, g = _rand(N, 6, 32), _rand(N, 192), _rand(32)
    heads = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32, device="cuda")
    for perm in (None, heads):
        y, yq = ops.norm.gated_xq(o, z, g, 1e-6, True, perm, xq=False)
        assert yq is None and torch.equal(_offered(ops, y), f16_rows(y))
    few = _rand(3, 64)  # decode rows (outside a step: by size) take no copy
    assert ops.linear.x16.find(ops.norm.rms(few, _rand(64), 1e-6, f16=True)) is None


def test_gated_activation_copies_are_the_conversion(cuda_ops) -> None:  # type: ignore[no-untyped-def]
    ops = cuda_ops
    gu = _rand(N, 2 * 96)  # gate and up as column slices of one projection, read in place
    for fn in (ops.act.silu_mul, ops.act.gelu_mul, ops.act.sigmoid_mul):
        out = fn(gu[:, :96], gu[:, 96:])
        assert torch.equal(_offered(ops, out), f16_rows(out)), fn.__name__


def test_gate_mix_copy_is_the_conversion(cuda_ops) -> None:  # type: ignore[no-untyped-def]
    ops = cuda_ops
    mixed = ops.hc.gate_mix(_rand(N, 4, 128), _rand(N, 4, 128))
    assert torch.equal(_offered(ops, mixed), f16_rows(mixed))
    ops.linear.x16.offers = False  # (the fixture restores it)
    assert ops.linear.x16.find(ops.hc.gate_mix(_rand(N, 4, 128), _rand(N, 4, 128))) is None


def test_combine_norm_is_combine_then_norm(cuda_ops) -> None:  # type: ignore[no-untyped-def]
    ops = cuda_ops
    for n, g, d in ((N, 4, 2560), (5, 3, 40), (N, 4, 64), (1, 1, 4)):
        x, out, inj, w = _rand(n, g, d), _rand(n, d), _rand(n, g), _rand(g, d)
        got = ops.norm.combine_rms(x, out, inj, w, 1e-6)
        assert got is not None, (n, g, d)
        want = ops.hc.combine(x, out, inj)
        assert torch.equal(got[0], want), f"streams differ at {(n, g, d)}"
        assert torch.equal(got[1], ops.norm.rms(want, w, 1e-6)), f"norm differs at {(n, g, d)}"
        if n > 8:
            flat = got[1].reshape(n, g * d)
            assert torch.equal(_offered(ops, flat), f16_rows(flat))
    odd = (_rand(3, 2, 6), _rand(3, 6), _rand(3, 2), _rand(2, 6))
    assert ops.norm.combine_rms(*odd, 1e-6) is None  # d % 4: hc_combine, then the norm


def test_prompt_combine_mix_keeps_its_bits(cuda_ops) -> None:  # type: ignore[no-untyped-def]
    """The prompt mix after a block (``combine_mix``) with the combine and norm fused or not."""
    from tests.cuda.test_hc import EPS, REAL, make_case, make_streams

    hc, d, r = REAL
    case = make_case(hc, d, r, ("Q4_K", "Q5_0", "Q4_K"), seed=9, device="cuda")
    x = make_streams(300, hc, d, seed=9).cuda()
    out, inj = _rand(300, d), torch.rand(300, hc, device="cuda") * 2.0
    runs = []
    for fused in (False, True):
        cuda_ops.hc.prompt_combine_norm = fused
        args = (case.norm, case.down, case.up, case.inject, EPS)
        runs.append(cuda_ops.hc.combine_mix(x, out, inj, *args))
    for name, a, b in zip(("streams", "mixed", "inject"), *runs, strict=True):
        assert torch.equal(a, b), f"{name} differ with the combine and norm fused"


@pytest.mark.parametrize("types", [("Q4_K", "Q5_0", "Q4_K"), ("BF16", "Q8_0", "BF16")])
def test_prompt_up_gate_keeps_its_bits(cuda_ops, monkeypatch: pytest.MonkeyPatch, types) -> None:  # type: ignore[no-untyped-def]
    """A prompt mix (300 rows: W decoded once) with up's GEMM and the gated mean in one kernel
    (``prompt_up_gate``: hgemm_wg_gate_mix) against the up GEMM, then hc_gate_mix: the same
    bits, the fused kernel run once."""
    from tests.cuda.test_hc import EPS, REAL, make_case, make_streams

    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=12, device="cuda")
    x = make_streams(300, hc, d, seed=12).cuda()
    hgemm = cuda_ops.linear.hgemm
    calls: list[int] = []
    real = hgemm.matmul_gate_mix
    monkeypatch.setattr(hgemm, "matmul_gate_mix", lambda *a: calls.append(1) or real(*a))
    runs = []
    for fused in (False, True):
        cuda_ops.hc.prompt_up_gate = fused
        runs.append(cuda_ops.hc.mix(x, case.norm, case.down, case.up, case.inject, EPS))
    assert calls == [1], f"the fused kernel ran {len(calls)} times"
    assert torch.equal(runs[0][0], runs[1][0]), f"{types}: mixed differs"
    assert torch.equal(runs[0][1], runs[1][1]), f"{types}: inject differs"
    assert torch.equal(_offered(cuda_ops, runs[1][0]), f16_rows(runs[1][0]))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3next", "qwen4exp"])
def test_prompt_logits_keep_their_bits_with_fewer_conversions(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts in one step with the producers' copies and the fused combine and norm on,
    then off: the same logits, bitwise, and fewer f16 conversions with them on."""
    b = _bench(_export(arch, tmp_path), "cuda")
    x16 = b.model.backend.linear.x16
    conversions: list[tuple[int, ...]] = []
    real = f16_rows_module.f16_rows
    monkeypatch.setattr(
        f16_rows_module, "f16_rows", lambda x: conversions.append(tuple(x.shape)) or real(x)
    )
    n_vocab = b.model.spec.n_vocab
    spans = [(0, tuple(_tokens(45, 1, n_vocab))), (1, tuple(_tokens(70, 2, n_vocab)))]
    runs = {}
    for on in (False, True):
        hc = b.model.backend.hc
        x16.offers = hc.prompt_combine_norm = hc.prompt_up_gate = on
        conversions.clear()
        runs[on] = (_all_logits(b.model, b.device, spans), len(conversions))
        x16.clear()
    (off, n_off), (on_, n_on) = runs[False], runs[True]
    assert torch.equal(off, on_), f"{arch}: logits differ with the producers' copies"
    # each layer's norm or mix outputs, and its gated activation, were converted: 2 a layer at
    # least are not now (qwen4exp: the normed streams, the mixes' outputs, the gated outputs)
    saved, layers = n_off - n_on, b.model.spec.n_layer
    assert saved >= 2 * layers, f"{arch}: {n_on} conversions with the copies, {n_off} without"
    qp = getattr(b.model, "qp", None)
    if qp is not None:  # the normed streams [N, hc * d] (down's and inject's input): never
        wide = [s for s in conversions if s[-1] == qp.hc * b.model.spec.n_embd]
        assert not wide, f"{arch}: the normed streams were converted {len(wide)} times"
