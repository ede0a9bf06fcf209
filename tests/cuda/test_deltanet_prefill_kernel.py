"""DeltaNet prefill on kernels/deltanet_chunked.cu (``DeltaNetCuda.prefill``).

CPU (CI): the wrapper's argument checks and fallbacks (a stub ``Kernels`` that must never launch),
and, where nvcc is installed, the kernels compiled for sm_90 with the wrapper's shared memory
sizes (the kernel static_asserts them), no spills, and at most 128 registers in the two 256-thread
kernels (two CTAs per SM).

GPU (marked): the kernels against three oracles on the same random inputs: the torch version
(``DeltaNetTorch.prefill``, fp32, chunk 64), the same chunked algebra in float64
(``delta_rule_chunked_device`` on float64 tensors) and the recurrent reference in float64 (one
token at a time). Compared: the output o [T, H_v, d], the slot's ssm state and its conv state (the
last K - 1 inputs, exact). Prompt lengths 1, 7, 63, 64, 65, 200, 4096 and 4161 (two launch pieces),
with a zero and a random entering state, weak (~-0.007 per token) and strong (~-14 per token) log
decay, GQA head maps (H_v / H_k = 3 as qwen4exp, 1, and 5 > the 4 value heads the solve handles
at once). Tolerances, fp32 against float64: o within 1e-5 + 1e-4 |o|, state within
1e-4 + 1e-4 |S| (observed on a CPU emulation of the kernels: ~1e-7 and ~5e-7).
Two runs are bitwise equal, and a session's results do not depend on the other slots.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference import deltanet, rowwise
from mgserve.cuda.ops.deltanet import DeltaNetTorch, split_qkv
from mgserve.cuda.ops.deltanet_chunked import delta_rule_chunked_device
from mgserve.cuda.ops.deltanet_cuda import DeltaNetCuda
from mgserve.cuda.ops.deltanet_prefill_cuda import PREFILL_SOURCE, prefill_defines
from tests.cuda.test_deltanet import close, rand
from tests.cuda.test_kernel_sources import NVCC, nvcc_source
from tests.cuda.test_moe_prefill import gpu_ms

EPS = 1e-6
O_TOL, S_TOL = (1e-5, 1e-4), (1e-4, 1e-4)  # (atol, rtol) of o and of the state against float64


def inputs(t: int, hk: int, hv: int, k: int, decay: float, seed: int, state: bool):
    """qkv [T, C], g, beta [T, H_v], conv [3, K - 1, C], ssm [3, H_v, d, d], weight [C, K] on the
    GPU; conv and ssm zero unless ``state``. Log decay -decay * softplus(N(0, 1))."""
    d = 128
    c = (2 * hk + hv) * d
    qkv = rand(t, c, seed=seed)
    g = -F.softplus(rand(t, hv, seed=seed + 1)) * decay
    beta = torch.sigmoid(rand(t, hv, seed=seed + 2))
    conv = rand(3, k - 1, c, seed=seed + 3) * float(state)
    ssm = rand(3, hv, d, d, seed=seed + 4, scale=0.3) * float(state)
    weight = rand(c, k, seed=seed + 5, scale=0.5)
    return qkv, g, beta, conv, ssm, weight


def oracle(qkv, g, beta, conv, ssm, slot, weight, hk, hv, recurrent):
    """(o, conv, ssm) of the slot in float64 on the tensors' device: conv, silu, L2 norms, then the
    chunked rule (chunk 64) or the recurrent one."""
    x = [t.double() for t in (qkv, g, beta, conv[slot], ssm[slot], weight)]
    y, new_conv = deltanet.causal_conv(x[0][None], x[3][None], x[5])
    q, k, v = split_qkv(rowwise.silu(y[0]), hk, hv, 128, EPS)
    if recurrent:
        o, s = deltanet.delta_rule_recurrent(q[None], k[None], v[None], x[1][None], x[2][None],
                                             x[4][None])  # fmt: skip
        return o[0], new_conv[0], s[0]
    o, s = delta_rule_chunked_device(q, k, v, x[1], x[2], x[4], 64)
    return o, new_conv[0], s


def check(cuda_ops, t, hk, hv, decay, seed, state, k=4, recurrent=False) -> None:
    qkv, g, beta, conv, ssm, weight = inputs(t, hk, hv, k, decay, seed, state)
    heads = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": 128, "eps": EPS}
    conv0, ssm0 = conv.clone(), ssm.clone()
    o = cuda_ops.deltanet.prefill(qkv, g, beta, conv, ssm, 1, weight, chunk=128, **heads)
    tag = f"T={t} H_k={hk} H_v={hv} decay={decay} state={state}"
    wants = [("float64 chunked", oracle(qkv, g, beta, conv0, ssm0, 1, weight, hk, hv, False))]
    if recurrent:
        rec = oracle(qkv, g, beta, conv0, ssm0, 1, weight, hk, hv, True)
        wants.append(("float64 recurrent", rec))
    c_t, s_t = conv0.clone(), ssm0.clone()
    o_t = DeltaNetTorch().prefill(qkv, g, beta, c_t, s_t, 1, weight, chunk=64, **heads)
    wants.append(("torch version fp32", (o_t, c_t[1], s_t[1])))
    for name, (want_o, want_c, want_s) in wants:
        close(f"{tag} o vs {name}", o, want_o, *O_TOL)
        close(f"{tag} ssm vs {name}", ssm[1], want_s, *S_TOL)
        close(f"{tag} conv vs {name}", conv[1], want_c, 0, 0)
    for s in (0, 2):
        assert torch.equal(ssm[s], ssm0[s]) and torch.equal(conv[s], conv0[s]), f"slot {s} changed"


# -- CPU: argument checks, fallbacks, compile ----------------------------------------------------


class NoLaunch:
    """A ``Kernels`` stand-in for cuda:0 that fails the test if anything compiles or launches."""

    device = torch.device("cuda", 0)

    def kernel(self, *args: object, **kw: object) -> None:
        raise AssertionError("a kernel was compiled")

    def launch(self, *args: object, **kw: object) -> None:
        raise AssertionError("a kernel was launched")


def cpu_inputs(t: int, hk: int, hv: int, d: int, k: int):
    gen = torch.Generator().manual_seed(0)
    c = (2 * hk + hv) * d
    return (
        torch.randn(t, c, generator=gen),
        -F.softplus(torch.randn(t, hv, generator=gen)),
        torch.sigmoid(torch.randn(t, hv, generator=gen)),
        torch.randn(2, k - 1, c, generator=gen),
        torch.randn(2, hv, d, d, generator=gen) * 0.3,
        torch.randn(c, k, generator=gen),
    )


def test_prefill_checks_and_fallbacks_on_cpu() -> None:
    ops = DeltaNetCuda(NoLaunch(), DeltaNetTorch())  # type: ignore[arg-type]
    qkv, g, beta, conv, ssm, w = cpu_inputs(5, 1, 2, 128, 4)
    heads = {"n_k_heads": 1, "n_v_heads": 2, "head_dim": 128, "eps": EPS}
    with pytest.raises(ValueError, match="qkv has shape"):
        ops.prefill(qkv[:0], g[:0], beta[:0], conv, ssm, 0, w, **heads)
    with pytest.raises(ValueError, match="g has shape"):
        ops.prefill(qkv, g[1:], beta, conv, ssm, 0, w, **heads)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        ops.prefill(qkv, g, beta, conv, ssm, 2, w, **heads)
    with pytest.raises(ValueError, match="qkv is on cpu, expected cuda:0"):
        ops.prefill(qkv, g, beta, conv, ssm, 0, w, **heads)
    with pytest.raises(ValueError, match="must be float32"):
        ops.prefill(qkv.double(), g, beta, conv, ssm, 0, w, **heads)
    # what the kernels do not cover runs the torch version (here on the CPU): head dim 16, conv
    # width 9, and the switch off
    cases = [(cpu_inputs(5, 1, 2, 16, 4), dict(heads, head_dim=16), True)]
    cases.append((cpu_inputs(5, 1, 2, 128, 9), heads, True))
    cases.append(((qkv, g, beta, conv, ssm, w), heads, False))
    for (x, gg, bb, cv, sm, ww), hh, on in cases:
        ops.prefill_kernels = on
        c1, s1, c2, s2 = cv.clone(), sm.clone(), cv.clone(), sm.clone()
        o = ops.prefill(x, gg, bb, c1, s1, 1, ww, **hh)
        want = DeltaNetTorch().prefill(x, gg, bb, c2, s2, 1, ww, **hh)
        assert torch.equal(o, want) and torch.equal(s1, s2) and torch.equal(c1, c2)


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_prefill_kernels_fit(tmp_path: Path) -> None:
    """The kernels compile for sm_90 with the wrapper's -D values (the kernel static_asserts
    PREP_SMEM / SCAN_SMEM against its layout), spill nothing, and the 256-thread kernels keep to
    128 registers (two CTAs per SM); wrong sizes do not compile."""
    src = tmp_path / "deltanet_chunked.cu"
    src.write_text(nvcc_source(PREFILL_SOURCE))

    def compile_(defines: tuple[tuple[str, str], ...]) -> subprocess.CompletedProcess[str]:
        cmd = [NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "--resource-usage", "-o", "/dev/null"]
        cmd += [f"-D{k}={v}" for k, v in defines] + [str(src)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    run = compile_(prefill_defines(128, 4))
    assert run.returncode == 0, run.stderr[-4000:]
    log = run.stdout + run.stderr
    usage = dict(re.findall(r"Function properties for (\w+)\n\s+(.*?)\n", log))
    regs = dict(re.findall(r"entry function '(\w+)'.*?Used (\d+) registers", log, re.S))
    assert set(usage) == {"conv_prefill_f32", "delta_prep_f32", "delta_scan_f32"}, run.stderr
    for name, line in usage.items():
        assert "0 bytes spill stores, 0 bytes spill loads" in line, f"{name}: {line}"
    assert int(regs["delta_prep_f32"]) <= 128 and int(regs["delta_scan_f32"]) <= 128, regs
    bad = tuple((k, str(int(v) + 4) if k == "SCAN_SMEM" else v) for k, v in prefill_defines(128, 4))
    assert compile_(bad).returncode != 0, "a wrong SCAN_SMEM compiled"


# -- GPU: against the oracles --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 63, 64, 65, 200])
@pytest.mark.parametrize("decay", [0.01, 20.0])
@pytest.mark.parametrize("state", [False, True])
def test_prefill_short(cuda_ops, t: int, decay: float, state: bool) -> None:
    """H_k 2, H_v 6 (value head j reads key head j // 3), against all three oracles."""
    check(cuda_ops, t, 2, 6, decay, seed=t, state=state, recurrent=True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [3, 130])
@pytest.mark.parametrize(("hk", "hv", "k"), [(1, 5, 4), (4, 4, 2), (3, 6, 8)])
def test_prefill_head_maps_and_conv_widths(cuda_ops, t: int, hk: int, hv: int, k: int) -> None:
    """H_v / H_k = 5 (more than the solve's 4 heads at once), 1, 2; conv widths 4, 2, 8 (with
    T = 3 < K - 1 the new conv state keeps some of the old one)."""
    check(cuda_ops, t, hk, hv, 1.0, seed=hk * 10 + hv, state=True, k=k, recurrent=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("t", "decay"), [(1, 1.0), (65, 1.0), (4096, 1.0), (4096, 20.0), (4161, 0.01)]
)
def test_prefill_qwen4exp(cuda_ops, t: int, decay: float) -> None:
    """H_k 16, H_v 48, d 128, K 4 (qwen4exp); 4161 tokens run as two launch pieces (4096 + 65)."""
    check(cuda_ops, t, 16, 48, decay, seed=t + int(decay), state=True)


@pytest.mark.gpu
def test_prefill_deterministic_and_alone(cuda_ops) -> None:
    """Two runs give the same bits, whatever the other slots hold; the other slots stay as they
    were."""
    heads = {"n_k_heads": 16, "n_v_heads": 48, "head_dim": 128, "eps": EPS}
    qkv, g, beta, conv, ssm, weight = inputs(1000, 16, 48, 4, 1.0, 7, True)
    runs = []
    for other in (0.0, 5.0):
        c, s = conv.clone(), ssm.clone()
        c[[0, 2]] += other
        s[[0, 2]] += other
        c0, s0 = c.clone(), s.clone()
        o = cuda_ops.deltanet.prefill(qkv, g, beta, c, s, 1, weight, **heads)
        assert torch.equal(c[[0, 2]], c0[[0, 2]]) and torch.equal(s[[0, 2]], s0[[0, 2]])
        runs.append((o, c[1], s[1]))
    for name, a, b in zip(("o", "conv", "ssm"), *runs, strict=True):
        assert torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.gpu
def test_prefill_split_prompt(cuda_ops) -> None:
    """A prompt prefilled as 130 + 70 tokens == as 200 (other chunk boundaries: within rounding)."""
    heads = {"n_k_heads": 2, "n_v_heads": 6, "head_dim": 128, "eps": EPS}
    qkv, g, beta, conv, ssm, weight = inputs(200, 2, 6, 4, 1.0, 8, True)
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    o1 = cuda_ops.deltanet.prefill(qkv, g, beta, c1, s1, 1, weight, **heads)
    o2 = torch.cat(
        [cuda_ops.deltanet.prefill(qkv[a:b], g[a:b], beta[a:b], c2, s2, 1, weight, **heads)
         for a, b in ((0, 130), (130, 200))]
    )  # fmt: skip
    close("split o", o2, o1, *O_TOL)
    close("split ssm", s2[1], s1[1], *S_TOL)
    assert torch.equal(c2, c1), "conv state differs"


@pytest.mark.gpu
@pytest.mark.parametrize("scan_tc", [False, True])
def test_prefill_pieces_give_the_same_bits(cuda_ops, monkeypatch: pytest.MonkeyPatch,
                                           scan_tc: bool) -> None:  # fmt: skip
    """4161 tokens at qwen4exp's heads in launch pieces of 1024 and 64 tokens == in 4096 + 65,
    bitwise (o, conv, ssm): pieces keep the chunks where they are (``check_piece``), and the
    state goes through memory as the scan holds it (fp32, or the tensor cores' accumulators)."""
    monkeypatch.setattr(cuda_ops.deltanet, "scan_tc", scan_tc)
    heads = {"n_k_heads": 16, "n_v_heads": 48, "head_dim": 128, "eps": EPS}
    qkv, g, beta, conv, ssm, weight = inputs(4161, 16, 48, 4, 1.0, 9, True)
    runs = []
    for piece in (4096, 1024, 64):
        monkeypatch.setattr(cuda_ops.deltanet, "prefill_piece", piece)
        c, s = conv.clone(), ssm.clone()
        o = cuda_ops.deltanet.prefill(qkv, g, beta, c, s, 1, weight, **heads)
        runs.append((o, c[1], s[1]))
    for other in runs[1:]:
        for name, a, b in zip(("o", "conv", "ssm"), runs[0], other, strict=True):
            assert torch.equal(a, b), f"{name} differs between pieces"


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "hk", "hv", "state"), [(4161, 16, 48, True), (65, 1, 5, False)])
def test_scan_widths_give_the_same_bits(cuda_ops, monkeypatch: pytest.MonkeyPatch, t: int,
                                        hk: int, hv: int, state: bool) -> None:  # fmt: skip
    """The scan on 16 state columns a CTA (twice the CTAs, three an SM) == on 32, bitwise (o,
    conv, ssm): each value's sums run in the same order whatever the thread mapping."""
    monkeypatch.setattr(cuda_ops.deltanet, "scan_tc", False)  # the fp32 scan's widths
    heads = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": 128, "eps": EPS}
    qkv, g, beta, conv, ssm, weight = inputs(t, hk, hv, 4, 1.0, 11, state)
    runs = []
    for cols in (32, 16):
        monkeypatch.setattr(cuda_ops.deltanet, "scan_cols", cols)
        c, s = conv.clone(), ssm.clone()
        o = cuda_ops.deltanet.prefill(qkv, g, beta, c, s, 1, weight, **heads)
        runs.append((o, c[1], s[1]))
    for name, a, b in zip(("o", "conv", "ssm"), *runs, strict=True):
        assert torch.equal(a, b), f"{name} differs between scan widths (T={t})"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("t", "hk", "hv", "decay", "state"),
    [(1, 2, 6, 1.0, True), (63, 2, 6, 20.0, False), (65, 1, 5, 0.01, True),
     (200, 3, 6, 1.0, True), (4096, 16, 48, 1.0, True), (4161, 16, 48, 0.01, True),
     (4096, 16, 48, 20.0, True)],
)  # fmt: skip
def test_scan_tc(cuda_ops, monkeypatch: pytest.MonkeyPatch, t: int, hk: int, hv: int,
                 decay: float, state: bool) -> None:  # fmt: skip
    """The scan on tensor cores (``scan_tc``, 3xTF32) against the three oracles at the fp32
    scan's tolerances (the recurrent one up to 200 tokens); two runs give the same bits."""
    monkeypatch.setattr(cuda_ops.deltanet, "scan_tc", True)
    check(cuda_ops, t, hk, hv, decay, seed=t + hv, state=state, recurrent=t <= 200)
    heads = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": 128, "eps": EPS}
    qkv, g, beta, conv, ssm, weight = inputs(t, hk, hv, 4, decay, t + hv, state)
    runs = []
    for _ in range(2):
        c, s = conv.clone(), ssm.clone()
        runs.append((cuda_ops.deltanet.prefill(qkv, g, beta, c, s, 1, weight, **heads), s[1]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_scan_widths() -> None:
    """A scan CTA takes 32 or 16 state columns (ValueError otherwise, the setting unchanged); the
    kernel is told the width only when it is not its default."""
    from types import SimpleNamespace

    from mgserve.cuda.ops.deltanet_prefill_cuda import check_scan_cols, prefill_smem

    kernels: Any = SimpleNamespace(device=torch.device("cpu"))
    family = DeltaNetCuda(kernels, DeltaNetTorch())
    assert family.scan_cols == 32
    family.scan_cols = 16
    for bad in (8, 64, 24):
        with pytest.raises(ValueError, match=r"one of \(32, 16\)"):
            family.scan_cols = bad
    assert family.scan_cols == 16 and check_scan_cols(32) == 32
    assert "SCAN_COLS" not in dict(prefill_defines(128, 4))
    narrow = dict(prefill_defines(128, 4, 16))
    assert narrow["SCAN_COLS"] == "16" and int(narrow["SCAN_SMEM"]) == prefill_smem(128, 16)[1]
    assert 3 * prefill_smem(128, 16)[1] <= 227 * 1024 < 3 * prefill_smem(128)[1]  # CTAs an SM


def test_scan_tc_needs_sm90() -> None:
    """The scan on tensor cores is a setting of sm_90 GPUs (wgmma's): on by default there,
    refused elsewhere, naming it."""
    from types import SimpleNamespace

    for wgmma in (False, True):
        kernels: Any = SimpleNamespace(device=torch.device("cpu"), wgmma=wgmma)
        family = DeltaNetCuda(kernels, DeltaNetTorch())
        assert family.scan_tc is wgmma
        if wgmma:
            family.scan_tc = False
            assert family.scan_tc is False
            family.scan_tc = True
            assert family.scan_tc is True
        else:
            with pytest.raises(ValueError, match="deltanet.scan_tc: .* sm_90"):
                family.scan_tc = True
            assert family.scan_tc is False
            family.scan_tc = False


def test_pieces_are_whole_chunks() -> None:
    """A piece is a whole number of 64-token chunks up to 4096 (ValueError naming the rule)."""
    from types import SimpleNamespace

    from mgserve.cuda.ops.deltanet_prefill_cuda import check_piece

    assert [check_piece(p) for p in (64, 1024, 4096)] == [64, 1024, 4096]
    kernels: Any = SimpleNamespace(device=torch.device("cpu"))  # no launch: the setting alone
    family = DeltaNetCuda(kernels, DeltaNetTorch())
    assert family.prefill_piece == 4096
    family.prefill_piece = 1024
    for bad in (0, 32, 100, 8192, 1024.0):
        with pytest.raises(ValueError, match="a multiple of 64 in 64..4096"):
            check_piece(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="a multiple of 64 in 64..4096"):
            family.prefill_piece = bad  # type: ignore[assignment]  # refused when set
    assert family.prefill_piece == 1024


@pytest.mark.gpu
def test_prefill_speed(cuda_ops) -> None:
    """4096 tokens at qwen4exp's heads, one layer: the kernels against the torch version
    (printed; run with -s). Asserted: the kernels are faster."""
    heads = {"n_k_heads": 16, "n_v_heads": 48, "head_dim": 128, "eps": EPS}
    qkv, g, beta, conv, ssm, weight = inputs(4096, 16, 48, 4, 1.0, 9, True)
    ms = {}

    def tc(*args: Any, **kw: Any) -> torch.Tensor:
        cuda_ops.deltanet.scan_tc = True
        try:
            return cuda_ops.deltanet.prefill(*args, **kw)
        finally:
            cuda_ops.deltanet.scan_tc = False

    runs = (("kernels", cuda_ops.deltanet.prefill), ("tensor cores", tc),
            ("torch", DeltaNetTorch().prefill))  # fmt: skip
    for name, fn in runs:
        ms[name] = gpu_ms(lambda fn=fn: fn(qkv, g, beta, conv, ssm, 1, weight, chunk=128, **heads))
    print(f"\ndeltanet prefill 4096 tokens x 48 heads: kernels {ms['kernels']:.2f} ms, "
          f"scan on tensor cores {ms['tensor cores']:.2f} ms, "
          f"torch version {ms['torch']:.2f} ms per layer")  # fmt: skip
    assert ms["kernels"] < ms["torch"] and ms["tensor cores"] < ms["torch"], ms
