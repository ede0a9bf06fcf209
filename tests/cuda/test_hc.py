"""HCCuda (kernels/hc.cu) against the reference hyper-connection mix in float64 on the CPU, on the
weights' stored values: the qwen4exp shape (hc 4, d 2560, r 320) and small odd ones, plain, Q8_0,
K-quant and other block formats (and mixed, as a Q4_K_M file has them), 1..20 tokens (several token
groups), the head's mix; the combine and the fused combine + mix bitwise against the unfused ops;
batch invariance and CUDA-graph replay bitwise; the torch fallback for shapes the kernels cannot
stage; and a timing print (``pytest -s -k timing``).

Tolerances. mixed = mean_s sigmoid(g_s) * xn_s, so its error is measured per element relative to
S = mean_s |xn_s|: xn carries ~2 ulp of rsqrtf, and the gate's pre-activation an fp32 sum of
hc * d (down) then r (up) products; with these O(1) pre-activations the CPU emulation of the
kernels measured ~2e-7 of S. We allow 2e-5 of S: a wrong row, stream or scale moves gates by
~1e-1 (errors ~1e-2 of S or more). inject is in (0, 2): absolute 2e-5.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mgserve.core.reference import hyper_connections as hcref
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.weights import QuantWeight, upload_bytes
from tests.cuda.test_hc_torch import EPS, HCCase, make_case, make_streams
from tests.cuda.test_linear_matvec import random_tensor

pytestmark = pytest.mark.gpu

RTOL_MIXED = 2e-5
ATOL_INJECT = 2e-5
REAL = (4, 2560, 320)  # hc, d, r of qwen4exp
REAL_N = [1, 2, 3, 8, 11, 16]  # the kernels (several token groups from 9 on)


def hc_cuda(kernels):
    """An HCCuda of its own (a fresh dense cache; a tuning to set) on the session's kernels."""
    from mgserve.cuda.ops.hc import HCTorch
    from mgserve.cuda.ops.hc_cuda import HCCuda
    from mgserve.cuda.ops.linear import LinearTorch
    from mgserve.cuda.ops.linear_cuda import LinearCuda
    from mgserve.cuda.ops.norm import NormCuda

    dense = DenseWeights()
    return HCCuda(
        kernels, HCTorch(dense), LinearCuda(kernels, LinearTorch(dense)), NormCuda(kernels)
    )


@pytest.fixture(scope="module")
def hcc(kernels):
    """The unclustered kernels (hc_down + hc_up; test_hc_cluster.py holds the clustered ones)."""
    ops = hc_cuda(kernels)
    ops.cluster = False
    return ops


def reference(
    x: torch.Tensor, case: HCCase
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(mixed, inject, S) in float64 on the CPU; S [N, d] = mean_s |xn_s|, the error scale."""
    r = case.ref
    ref = hcref.HCWeights(
        r.norm.double(),
        r.down.double(),
        r.up.double(),
        None if r.inject is None else r.inject.double(),
    )
    x64 = x.double().cpu()
    mixed, inj = hcref.mix(x64, ref, EPS)
    scale = hcref.grouped_norm(x64, ref.norm, EPS).abs().mean(dim=1)
    return mixed, inj, scale


def fused_mix(hcc, case: HCCase, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernels' mix for any N (outside a runner step ``mix`` takes the GEMMs above 8 tokens,
    as the linear family does; the kernels run larger batches as several token groups)."""
    _, mixed, inj = hcc._run(x, None, None, case.norm, case.down, case.up, case.inject, EPS)
    return mixed, inj


def check_mix(hcc, case: HCCase, x: torch.Tensor, label: str) -> tuple[float, float]:
    """Runs the kernels on x (CPU, copied over) and asserts the tolerances; returns the errors."""
    mixed, inj = fused_mix(hcc, case, x.cuda())
    torch.cuda.synchronize()
    want_mixed, want_inj, scale = reference(x, case)
    n, _, d = x.shape
    assert mixed.shape == (n, d), f"{label}: mixed shape {list(mixed.shape)}"
    assert torch.isfinite(mixed).all(), f"{label}: non-finite mixed"
    err = ((mixed.double().cpu() - want_mixed).abs() / scale.clamp_min(1e-30)).max().item()
    assert err <= RTOL_MIXED, f"{label}: mixed error {err:.3e} of S (tolerance {RTOL_MIXED})"
    err_inj = 0.0
    if case.inject is None:
        assert inj is None, f"{label}: head mix returned an inject"
    else:
        assert inj is not None and inj.shape == (n, case.hc), f"{label}: inject shape"
        err_inj = (inj.double().cpu() - want_inj).abs().max().item()
        assert err_inj <= ATOL_INJECT, f"{label}: inject error {err_inj:.3e}"
    return err, err_inj


@pytest.mark.parametrize(
    "types",
    [
        "BF16", "F16", "F32", "Q8_0", ("Q8_0", "BF16", "F32"), ("BF16", "F32", "F16"),
        ("Q4_K", "Q5_0", "Q4_K"),  # what llama-quantize Q4_K_M writes (320-wide up rows: Q5_0)
        ("Q6_K", "Q8_0", "Q6_K"),  # its "more bits" layers
        ("Q5_K", "Q4_0", "IQ4_XS"),
    ],
)  # fmt: skip
def test_mix_real_shape(hcc, types: str | tuple[str, str, str]) -> None:
    """qwen4exp's shape, 1..16 tokens (groups of 1, 2, 4, 8; several groups from 9 on). Mixed
    formats: down and inject differ, so hc_down runs twice."""
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=1, device="cuda")
    errors = [
        check_mix(hcc, case, make_streams(n, hc, d, seed=n), f"{types} N={n}") for n in REAL_N
    ]
    print(f"hc_mix {types}: errors (mixed, inject) {[(f'{a:.1e}', f'{b:.1e}') for a, b in errors]}")


def test_prompt_chunks_take_gemms(hcc) -> None:
    """More than 8 tokens outside a runner step: ``hyper_connections.mix_with`` on the linear
    family's f16 GEMMs and the norm kernel, within the f16 products' rounding."""
    hc, d, r = REAL
    case = make_case(hc, d, r, "BF16", seed=3, device="cuda")
    x = make_streams(40, hc, d, seed=3)
    mixed, inj = hcc.mix(x.cuda(), case.norm, case.down, case.up, case.inject, EPS)
    want_mixed, want_inj, scale = reference(x, case)
    err = ((mixed.double().cpu() - want_mixed).abs() / scale.clamp_min(1e-30)).max().item()
    assert inj is not None and want_inj is not None
    err_inj = (inj.double().cpu() - want_inj).abs().max().item()
    print(f"hc_mix N=40 (GEMMs): errors {err:.1e} {err_inj:.1e}")
    assert err <= 5e-3 and err_inj <= 5e-3, f"GEMM mix errors {err:.2e}, {err_inj:.2e}"


def test_prompt_gate_kernel_is_the_torch_ops_bitwise(hcc, monkeypatch: pytest.MonkeyPatch) -> None:
    """hc_gate_mix against ``hyper_connections.gated_mean`` (the torch ops it replaces) on the
    same inputs: the same bits, for hc 4 and not a power of two, wide and narrow streams, one
    token and a chunk; then a whole prompt mix with the kernel against without it."""
    g = torch.Generator().manual_seed(5)
    for n, hc, d in ((1, 4, 2560), (300, 4, 2560), (7, 3, 40), (2, 5, 8)):
        u = (4 * torch.randn(n, hc, d, generator=g)).cuda()
        xn = torch.randn(n, hc, d, generator=g).cuda()
        got = hcc.gate_mix(u, xn)
        assert torch.equal(got, hcref.gated_mean(u, xn)), f"gated mean N {n} hc {hc} d {d}"
    hc, d, r = REAL
    case = make_case(hc, d, r, "BF16", seed=4, device="cuda")
    x = make_streams(40, hc, d, seed=4).cuda()
    monkeypatch.setattr(hcc, "prompt_gate_kernel", False)
    want = hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    monkeypatch.setattr(hcc, "prompt_gate_kernel", True)
    got = hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    assert torch.equal(got[0], want[0]) and got[1] is not None and torch.equal(got[1], want[1])


@pytest.mark.parametrize("types", [("Q4_K", "Q5_0", "Q4_K"), ("Q4_K", "Q5_0", "F32"), "BF16"])
def test_prompt_mix_stacks_inject_bitwise(hcc, monkeypatch: pytest.MonkeyPatch, types) -> None:  # type: ignore[no-untyped-def]
    """A prompt chunk's mix (300 rows: W decoded once, hgemm) with down and inject in one GEMM
    (``hc.stack_inject``, linear_stacked.py) against one GEMM each: the same bits, in two GEMM
    launches instead of three; inject in down's format or another; on hgemm_wgmma.cu and on
    hgemm.cu."""
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=6, device="cuda")
    x = make_streams(300, hc, d, seed=6).cuda()
    calls: list[int] = []
    hgemm = hcc.linear.hgemm
    gemm = hgemm.matmul
    monkeypatch.setattr(hgemm, "matmul", lambda *a: calls.append(1) or gemm(*a))
    for wgmma in sorted({False, hgemm.wgmma}):
        monkeypatch.setattr(hgemm, "wgmma", wgmma)
        runs = []
        for on in (False, True):
            monkeypatch.setattr(hcc, "stack_inject", on)
            calls.clear()
            runs.append((hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS), len(calls)))
        (want, n_want), (got, n_got) = runs
        tag = f"{types} wgmma {wgmma}"
        assert (n_want, n_got) == (3, 2), f"{tag}: GEMM launches {n_want} apart, {n_got} stacked"
        assert torch.equal(got[0], want[0]), f"{tag}: mixed differs"
        assert got[1] is not None and want[1] is not None and torch.equal(got[1], want[1]), tag


ODD = [  # (N, hc, d, r, formats): idle lanes, partial CTAs, hc not 4, hc > 4
    (5, 3, 40, 24, "F32"),
    (9, 5, 72, 16, "BF16"),
    (4, 3, 40, 16, "F16"),
    (6, 4, 64, 64, ("Q8_0", "BF16", "F32")),
    (2, 2, 272, 32, "Q8_0"),
    (13, 4, 1536, 96, "BF16"),  # N=13: groups of 8 + 5, each stream staged in 2 parts of 768
    (8, 4, 4096, 128, "BF16"),  # 8 tokens: the stream staged in 4 parts of 1024
    (3, 4, 64, 32, ("Q4_K", "Q5_0", "Q4_K")),  # a 256-value block spans all four streams
    (9, 2, 384, 64, ("Q6_K", "Q5_1", "IQ4_NL")),  # a block spans streams; 9 tokens: 2 groups
    (5, 4, 1536, 96, ("Q4_K", "Q4_1", "Q6_K")),  # staged parts of 768 inside 256-value blocks
]


@pytest.mark.parametrize("shape", ODD)
def test_mix_odd_shapes(hcc, shape: tuple) -> None:
    n, hc, d, r, types = shape
    case = make_case(hc, d, r, types, seed=n + d, device="cuda")
    err, err_inj = check_mix(hcc, case, make_streams(n, hc, d, seed=d), f"{shape}")
    print(f"hc_mix {shape}: errors {err:.1e} {err_inj:.1e}")


@pytest.mark.parametrize("types", ["BF16", ("Q8_0", "F16", "Q8_0")])
def test_head_mix(hcc, types: str | tuple[str, str, str]) -> None:
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=2, head=True, device="cuda")
    for n in (1, 5):
        check_mix(hcc, case, make_streams(n, hc, d, seed=n), f"head {types} N={n}")


def test_combine_is_torch_bitwise(hcc) -> None:
    g = torch.Generator().manual_seed(3)
    for n, hc, d in ((1, 4, 2560), (7, 4, 2560), (3, 3, 40), (2, 4, 6)):  # d=6: torch fallback
        x = torch.randn(n, hc, d, generator=g).cuda()
        out = torch.randn(n, d, generator=g).cuda()
        inj = (torch.rand(n, hc, generator=g) * 2).cuda()
        y = hcc.combine(x, out, inj)
        want = x + inj[:, :, None] * out[:, None, :]
        assert torch.equal(y, want), (
            f"combine {n, hc, d}: max diff {(y - want).abs().max().item():.3e}"
        )


@pytest.mark.parametrize("types", ["BF16", ("Q8_0", "BF16", "F32")])
def test_combine_mix_is_combine_then_mix(hcc, types: str | tuple[str, str, str]) -> None:
    """The fused op writes the same new streams and the same mix, bitwise."""
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=4, device="cuda")
    g = torch.Generator().manual_seed(4)
    for n in (1, 4, 11):
        x = make_streams(n, hc, d, seed=n).cuda()
        out = torch.randn(n, d, generator=g).cuda()
        inj_prev = (torch.rand(n, hc, generator=g) * 2).cuda()
        x_new, mixed, inj = hcc.combine_mix(
            x, out, inj_prev, case.norm, case.down, case.up, case.inject, EPS
        )
        want_x = hcc.combine(x, out, inj_prev)
        want_mixed, want_inj = hcc.mix(want_x, case.norm, case.down, case.up, case.inject, EPS)
        assert torch.equal(x_new, want_x), f"{types} N={n}: fused new x differs"
        assert torch.equal(mixed, want_mixed), (
            f"{types} N={n}: fused mixed differs by {(mixed - want_mixed).abs().max().item():.3e}"
        )
        assert inj is not None and want_inj is not None and torch.equal(inj, want_inj)


@pytest.mark.parametrize("types", ["BF16", "Q8_0", ("Q4_K", "Q5_0", "Q4_K")])
def test_batch_invariant(hcc, types: str | tuple[str, str, str]) -> None:
    """Tokens 0 and 9 give bitwise the same results alone as in batches of 3, 8, 13 and 16
    (token groups 4 and 8, one part or two, token 9 in the second group)."""
    hc, d, r = REAL
    case = make_case(hc, d, r, types, seed=5, device="cuda")
    x = make_streams(16, hc, d, seed=5).cuda()

    def run(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        mixed, inj = fused_mix(hcc, case, x[rows])
        assert inj is not None
        return mixed, inj

    alone = {t: run(slice(t, t + 1)) for t in (0, 9)}
    for n in (3, 8, 13, 16):
        mixed, inj = run(slice(0, n))
        for t, (m1, i1) in alone.items():
            if t >= n:
                continue
            diff = (mixed[t] - m1[0]).abs().max().item()
            assert torch.equal(mixed[t], m1[0]), f"{types}: token {t} in {n} differs by {diff:.3e}"
            assert torch.equal(inj[t], i1[0]), f"{types}: token {t}'s inject differs in {n}"


def test_norm_scales_once_per_cta_are_the_same_bits(hcc, kernels) -> None:
    """hc_up with each norm scale computed once per CTA (the default) and wherever read (the
    kernel before 2026-12-06): the same mixed and inject, bitwise, 1..11 tokens."""
    from mgserve.cuda.ops.hc import HCTuning

    hc, d, r = REAL
    case = make_case(hc, d, r, ("Q4_K", "Q5_0", "Q4_K"), seed=9, device="cuda")
    old = hc_cuda(kernels)
    old.tuning, old.cluster = HCTuning(inv_once=False), False
    assert hcc.tuning.inv_once
    for n in (1, 3, 8, 11):
        x = make_streams(n, hc, d, seed=n).cuda()
        got = hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS)
        want = old.mix(x, case.norm, case.down, case.up, case.inject, EPS)
        for name, a, b in zip(("mixed", "inject"), got, want, strict=True):
            assert a is not None and b is not None and torch.equal(a, b), f"N={n}: {name}"


@pytest.mark.parametrize("n", [1, 4, 8])
def test_graph_capture(hcc, n: int) -> None:
    """combine_mix then mix captured once, replayed with new streams: bitwise the eager ops."""
    hc, d, r = REAL
    case = make_case(hc, d, r, ("BF16", "BF16", "Q8_0"), seed=6, device="cuda")
    g = torch.Generator().manual_seed(6)
    inputs = [
        (
            make_streams(n, hc, d, seed=10 + i),
            torch.randn(n, d, generator=g),
            torch.rand(n, hc, generator=g) * 2,
        )
        for i in range(2)
    ]

    def step(x: torch.Tensor, out: torch.Tensor, ip: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_new, _, inj = hcc.combine_mix(x, out, ip, case.norm, case.down, case.up, case.inject, EPS)
        assert inj is not None
        mixed, inj2 = hcc.mix(x_new, case.norm, case.down, case.up, case.inject, EPS)
        assert inj2 is not None
        return x_new, mixed, inj2

    assert_replays_match_eager(step, inputs, f"N={n}")


def assert_replays_match_eager(step, inputs: list[tuple[torch.Tensor, ...]], label: str) -> None:
    """``step(x, out, inject_prev) -> (x, mixed, inject)`` captured once on the first inputs,
    then replayed on each (copied into the captured ones): bitwise an eager call's results."""
    sx, so, si = (t.cuda() for t in inputs[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(sx, so, si)  # warm-up: compile, cache the stream's view
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        outs = step(sx, so, si)
    for x, out, ip in reversed(inputs):
        sx.copy_(x)
        so.copy_(out)
        si.copy_(ip)
        graph.replay()
        torch.cuda.synchronize()
        eager = step(x.cuda(), out.cuda(), ip.cuda())
        for name, a, b in zip(("x", "mixed", "inject"), outs, eager, strict=True):
            assert torch.equal(a, b), f"{label}: graph replay's {name} differs from an eager call"


def test_unstageable_shapes_fall_back_to_torch(kernels) -> None:
    """A stream too wide for shared memory with no 256-aligned split (d = 1480 for 8 tokens):
    the torch version, bitwise, and still correct."""
    hcc = hc_cuda(kernels)  # fresh: the dense cache is keyed by address
    hc, d, r = 2, 1480, 16
    assert not hcc.kernels_apply(hc, d, r, ())
    case = make_case(hc, d, r, "F32", seed=7, device="cuda")
    x = make_streams(3, hc, d, seed=7).cuda()
    mixed, inj = hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    want_mixed, want_inj = hcc.fallback.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    assert torch.equal(mixed, want_mixed) and inj is not None and want_inj is not None
    assert torch.equal(inj, want_inj)
    check_mix(hcc, case, x.cpu(), "unstageable fallback")


def test_rejects_bad_input(hcc) -> None:
    hc, d, r = 4, 64, 32
    case = make_case(hc, d, r, "BF16", seed=8, device="cuda")
    x = make_streams(2, hc, d, seed=8)
    with pytest.raises(ValueError, match="x is on cpu"):
        hcc.mix(x, case.norm, case.down, case.up, case.inject, EPS)
    with pytest.raises(ValueError, match="norm has shape"):
        hcc.mix(x.cuda(), case.norm[:, :8], case.down, case.up, case.inject, EPS)
    with pytest.raises(ValueError, match="out has shape"):
        hcc.combine(x.cuda(), torch.zeros(2, d + 1, device="cuda"), torch.zeros(2, hc).cuda())
    cpu = make_case(hc, d, r, "BF16", seed=8)
    with pytest.raises(ValueError, match="weight bytes"):
        hcc.mix(x.cuda(), case.norm, cpu.down, case.up, case.inject, EPS)


# ---- timing --------------------------------------------------------------------------------------


def _timing_weight(type_name: str, name: str, rows: int, k: int, std: float) -> QuantWeight:
    """A random weight on the GPU: BF16 made there (bf16 elements are GGUF BF16 rows as they
    are), other formats valid random blocks made on the host."""
    if type_name != "BF16":
        raw = random_tensor(type_name, rows, k, np.random.default_rng(rows + k))
        return upload_bytes(name, type_name, (k, rows), raw, "cuda")
    v = (torch.randn(rows, k, device="cuda") * std).to(torch.bfloat16)
    return QuantWeight(name, "BF16", (k, rows), v.view(torch.uint8).reshape(rows, k * 2))


@pytest.mark.parametrize("types", ["BF16", ("Q4_K", "Q5_0", "Q4_K")])
def test_timing(hcc, kernels, types: str | tuple[str, str, str]) -> None:
    """Prints GPU time per mix at qwen4exp's shape (BF16, and the Q4_K_M file's formats),
    replaying a CUDA graph of 16 mixes that cycle through 8 weight sets (more than L2, as a
    model's 97 mixes are). For tuning: ``pytest -s -k timing``; MGSERVE_HC_SWEEP=1 also times a
    few other HCTunings (each compiles hc.cu once more). Nothing is asserted beyond sanity."""
    from mgserve.cuda.ops.hc import HCTorch, HCTuning

    hc, d, r = REAL
    k = hc * d
    down_t, up_t, inj_t = (types, types, types) if isinstance(types, str) else types
    sets = []
    for i in range(8):
        norm = 1 + 0.1 * torch.randn(hc, d, device="cuda")
        sets.append(
            (
                norm,
                _timing_weight(down_t, f"down{i}", r, k, k**-0.5),
                _timing_weight(up_t, f"up{i}", k, r, r**-0.5),
                _timing_weight(inj_t, f"inject{i}", hc, k, k**-0.5),
            )
        )
    nbytes = sum(w.nbytes for w in sets[0][1:])
    s = torch.cuda.Stream()

    def time_us(fn, x: torch.Tensor) -> float:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(x, 0)  # warm-up
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for i in range(16):
                fn(x, i % len(sets))
        graph.replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 80 * 1e3

    def mix_with(ops):
        def fn(x: torch.Tensor, i: int) -> None:
            ops.mix(x, *sets[i], EPS)

        return fn

    def combine_mix(x: torch.Tensor, i: int) -> None:
        out, ip = prev[x.shape[0]]
        hcc.combine_mix(x, out, ip, *sets[i], EPS)

    torch_ops = None
    if types == "BF16":
        torch_ops = HCTorch(DenseWeights())
        for _, down, up, inject in sets:  # dense f32 copies without the host round trip
            for w in (down, up, inject):
                torch_ops.dense._dense[w.data.data_ptr()] = w.data.view(torch.bfloat16).float()
    prev = {n: (torch.randn(n, d, device="cuda"), torch.ones(n, hc, device="cuda")) for n in (1, 8)}
    clustered = hc_cuda(kernels)  # the other setting of HCCuda.cluster, side by side
    clustered.cluster = not hcc.cluster
    for n in (1, 2, 4, 8, 16):
        x = torch.randn(n, hc, d, device="cuda")
        us = time_us(mix_with(hcc), x)
        line = f"hc_mix {types} N={n}: {us:.1f} us per mix, {nbytes / us / 1e3:.0f} GB/s of weights"
        other = time_us(mix_with(clustered), x)
        line += f"; cluster {'off' if hcc.cluster else 'on'} {other:.1f} us"
        if n in (1, 8):
            line += f"; fused combine+mix {time_us(combine_mix, x):.1f} us"
            if torch_ops is not None:
                line += f"; torch {time_us(mix_with(torch_ops), x):.1f} us"
        print(line)
        assert us > 0
    if os.environ.get("MGSERVE_HC_SWEEP"):
        tunings = [
            HCTuning(inv_once=False, up_warps=4, up_cols=(2, 2, 4, 4)),  # before 2026-12-06
            HCTuning(inv_once=False),
            HCTuning(up_warps=4, up_cols=(2, 2, 4, 4)),
            HCTuning(split_blocks=False),
            HCTuning(prefetch=False),
            HCTuning(down_warps=4),
            HCTuning(up_warps=4),
            HCTuning(up_cols=(1, 2, 4, 4), down_rows=(1, 1, 2, 2)),
            HCTuning(up_cols=(4, 4, 4, 8), up_batch=(5, 5, 5, 2)),
            HCTuning(up_batch=(3, 3, 3, 3), down_batch=(5, 5, 5, 5)),
            HCTuning(up_batch=(2, 2, 2, 2), down_batch=(3, 3, 3, 3), down_warps=4),
            HCTuning(up_cols=(1, 1, 1, 1)),  # more hc_up CTAs (N=8: 320 instead of 160)
            HCTuning(up_cols=(1, 1, 2, 2), up_warps=2),
            HCTuning(up_cols=(2, 2, 2, 2), down_rows=(1, 1, 1, 1)),
            HCTuning(down_warps=4, down_rows=(1, 1, 1, 1), up_cols=(1, 1, 1, 1)),
        ]
        for tuning in tunings:  # MGSERVE_HC_SWEEP=cluster: each on clusters (hc_cluster.py)
            alt = hc_cuda(kernels)
            alt.tuning = alt.cluster_tuning = tuning
            alt.cluster = os.environ["MGSERVE_HC_SWEEP"] == "cluster"
            times = [time_us(mix_with(alt), torch.randn(n, hc, d, device="cuda")) for n in (1, 8)]
            label = f"{types}{' cluster' if alt.cluster else ''} {tuning}"
            print(f"{label}: N=1 {times[0]:.1f} us, N=8 {times[1]:.1f} us")
