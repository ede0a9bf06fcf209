"""The CUDA MoE family (moe.cu, moe_q8.cu, the bucketed prefill) against the reference MoE, in
float64 on the CPU (test_linear.py: dequantize and linear).

Tolerances (see test_moe_torch.py for the error scales and how they were measured), of
S = sum_j w_j |down| @ |h|: fp32 decode 2e-5, f16 prefill 2e-3, int8 decode 2e-2. Batch
invariance and graph replay: bitwise.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from mgserve.cuda.weights import FORMATS
from tests.cuda.test_moe_torch import (
    RTOL_F16,
    RTOL_FP32,
    RTOL_INT8,
    ExpertCase,
    bound_error,
    make_case,
    make_weight,
    reference_moe,
    routing,
)

pytestmark = pytest.mark.gpu

TYPES = sorted(FORMATS)
Q8_TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]


@functools.cache
def target_case(down_type: str) -> ExpertCase:
    """qwen4exp's MoE layer: d 2560, ff 640, 256 experts, gate/up Q4_K (built once: ~0.8 GB)."""
    return make_case("Q4_K", down_type, 256, 2560, 640, fused=False, seed=9, device="cuda")


def run_moe(
    m, case: ExpertCase, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    y = m.moe.experts(x.cuda(), case.w, experts.cuda(), weights.cuda())
    torch.cuda.synchronize()
    return y.cpu()


def check_moe(
    m, case: ExpertCase, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, tol: float
) -> float:
    y = run_moe(m, case, x, experts, weights)
    assert y.shape == x.shape and torch.isfinite(y).all(), "unwritten or non-finite outputs"
    ref, scale = reference_moe(case, x, experts, weights)
    err = bound_error(y, ref, scale)
    label = f"{case.gate_type}/{case.down_type} E={case.w.n_expert} d={case.d} ff={case.w.n_ff}"
    assert err <= tol, f"{label} N={x.shape[0]} kk={experts.shape[1]}: error {err:.2e} > {tol}"
    return err


# ---- MoE decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_moe_decode_matches_reference(cuda_ops, type_name: str) -> None:
    """All formats, separate and fused gate/up, N = 1, 3, 8 tokens x 10 of 16 experts."""
    i = TYPES.index(type_name)
    case = make_case(type_name, type_name, 16, 256, 256, fused=i % 2 == 1, seed=i, device="cuda")
    rng = np.random.default_rng(200 + i)
    errors = []
    for n in (1, 3, 8):
        x = torch.from_numpy(rng.standard_normal((n, 256), dtype=np.float32))
        experts, weights = routing(n, 10, 16, rng)
        errors.append(check_moe(cuda_ops, case, x, experts, weights, RTOL_FP32))
    print(f"moe decode {type_name}: max error {max(errors):.2e} (N = 1, 3, 8)")


@pytest.mark.parametrize("down_type", ["Q5_0", "Q8_0"])
def test_moe_decode_target_shape(cuda_ops, cuda_ops_int8, down_type: str) -> None:
    """The target layer, 10 experts per token; the first and last experts are selected (row
    offsets near the end of the 256-expert tensors)."""
    case = target_case(down_type)
    rng = np.random.default_rng(9)
    x = torch.from_numpy(rng.standard_normal((2, 2560), dtype=np.float32))
    experts, weights = routing(2, 10, 256, rng)
    experts[0, 0], experts[1, 9] = 255, 0  # (a repeated id is fine: its slots just add up)
    e32 = check_moe(cuda_ops, case, x, experts, weights, RTOL_FP32)
    e8 = check_moe(cuda_ops_int8, case, x, experts, weights, RTOL_INT8)
    print(f"moe Q4_K/{down_type} target shape: error fp32 {e32:.1e}, int8 {e8:.1e}")


@pytest.mark.parametrize("gate_type", Q8_TYPES)
def test_moe_decode_int8_matches_reference(cuda_ops_int8, gate_type: str) -> None:
    """int8 kernels for each int8 format as gate/up and as down, and an int8 gate/up with a
    down format that has no int8 kernel (Q4_1: the fp32 down kernel reads h)."""
    i = Q8_TYPES.index(gate_type)
    for j, down_type in enumerate([Q8_TYPES[(i + 1) % 4], "Q4_1"]):
        case = make_case(gate_type, down_type, 16, 256, 256, fused=j == 1, seed=i, device="cuda")
        rng = np.random.default_rng(300 + i)
        for n in (1, 5):
            x = torch.from_numpy(rng.standard_normal((n, 256), dtype=np.float32))
            x[0, :32] = 0.0  # an all-zero group: scale 0 must give 0, not NaN
            experts, weights = routing(n, 10, 16, rng)
            check_moe(cuda_ops_int8, case, x, experts, weights, RTOL_INT8)


@pytest.mark.parametrize("int8", [False, True])
def test_moe_decode_batch_invariant(cuda_ops, cuda_ops_int8, int8: bool) -> None:
    """Token 0's output is bitwise the same alone, beside 3 others and beside 7 others (some of
    which share its experts)."""
    m = cuda_ops_int8 if int8 else cuda_ops
    case = target_case("Q5_0")
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((8, 2560), dtype=np.float32))
    experts, weights = routing(8, 10, 256, rng)
    experts[1:4, :3] = experts[0, :3]  # shared experts
    ys = [run_moe(m, case, x[:n], experts[:n], weights[:n]) for n in (1, 4, 8)]
    assert torch.equal(ys[0][0], ys[1][0]) and torch.equal(ys[0][0], ys[2][0]), (
        f"token 0 differs with the batch: max diff "
        f"{(ys[0][0] - ys[2][0]).abs().max().item():.3e} (1 vs 8 tokens)"
    )
    assert torch.equal(ys[1], ys[2][:4])


@pytest.mark.parametrize("int8", [False, True])
def test_moe_decode_graph_capture(cuda_ops, cuda_ops_int8, int8: bool) -> None:
    """A captured decode step replays with new routing written into its static inputs."""
    m = cuda_ops_int8 if int8 else cuda_ops
    case = make_case("Q8_0", "Q6_K", 16, 256, 256, fused=True, seed=6, device="cuda")
    rng = np.random.default_rng(6)
    inputs = []
    for _ in range(2):
        x = torch.from_numpy(rng.standard_normal((4, 256), dtype=np.float32))
        inputs.append((x, *routing(4, 10, 16, rng)))
    sx, se, sw = (t.cuda() for t in inputs[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.moe.experts(sx, case.w, se, sw)  # warm-up: compile, cache the stream's view
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        sy = m.moe.experts(sx, case.w, se, sw)
    for x, experts, weights in reversed(inputs):
        sx.copy_(x)
        se.copy_(experts)
        sw.copy_(weights)
        graph.replay()
        torch.cuda.synchronize()
        eager = run_moe(m, case, x, experts, weights)
        assert torch.equal(sy.cpu(), eager), "graph replay differs from an eager call"


def test_moe_decode_timing(cuda_ops, cuda_ops_int8) -> None:
    """Prints the decode kernels' GPU time and bandwidth at the target shape, replaying a CUDA
    graph of 10 calls (so Python's launch cost is not measured). For tuning: ``pytest -s -k
    timing``; nothing is asserted beyond sanity."""
    rng = np.random.default_rng(13)
    s = torch.cuda.Stream()
    for down_type in ("Q5_0", "Q8_0"):
        case = target_case(down_type)
        gate_row = 2560 // 256 * FORMATS["Q4_K"].nbytes
        down_row = 640 // FORMATS[down_type].block * FORMATS[down_type].nbytes
        for n in (1, 8):
            x = torch.from_numpy(rng.standard_normal((n, 2560), dtype=np.float32)).cuda()
            experts, weights = (t.cuda() for t in routing(n, 10, 256, rng))
            n_used = len(set(experts.flatten().tolist()))
            nbytes = n_used * (2 * 640 * gate_row + 2560 * down_row)
            for label, m in (("fp32", cuda_ops), ("int8", cuda_ops_int8)):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    m.moe.experts(x, case.w, experts, weights)  # warm-up
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=s):
                    for _ in range(10):
                        m.moe.experts(x, case.w, experts, weights)
                graph.replay()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                for _ in range(5):
                    graph.replay()
                stop.record()
                stop.synchronize()
                us = start.elapsed_time(stop) / 50 * 1e3
                print(
                    f"moe decode Q4_K/{down_type} N={n} {label}: {us:.1f} us per layer, "
                    f"{nbytes / us / 1e3:.0f} GB/s ({n_used} distinct experts)"
                )
                assert us > 0


# ---- MoE prefill ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gate_type", "down_type", "fused"),
    [("Q4_K", "Q8_0", False), ("Q6_K", "Q5_0", True), ("Q5_0", "Q4_K", False)],
)
def test_moe_prefill_matches_reference(
    cuda_ops, monkeypatch: pytest.MonkeyPatch, gate_type: str, down_type: str, fused: bool
) -> None:
    """300 tokens x 4 of 16 experts: expert 11 chosen by every token (at a random slot), experts
    12..15 by none, the rest by ~80 tokens each. Three scratch budgets split the 12 used experts
    into chunks of 12, 6 and 1 on the cuBLAS path (padded batched products, and none), and the
    default grouped path: all must agree with the reference; and 9 tokens (the smallest
    prefill)."""
    from mgserve.cuda.ops import linear_cuda

    d = ff = 256
    case = make_case(gate_type, down_type, 16, d, ff, fused=fused, seed=12, device="cuda")
    rng = np.random.default_rng(12)
    n, kk = 300, 4
    x = torch.from_numpy(rng.standard_normal((n, d), dtype=np.float32))
    rows = [rng.permutation([11, *rng.permutation(11)[: kk - 1]]) for _ in range(n)]
    experts = torch.from_numpy(np.stack(rows).astype(np.int32))
    weights = torch.from_numpy(rng.uniform(0.05, 1.0, size=(n, kk)).astype(np.float32))
    ref, scale = reference_moe(case, x, experts, weights)
    errors = []
    check_moe(cuda_ops, case, x[:9], experts[:9], weights[:9], RTOL_F16)
    for budget in (0, linear_cuda.SCRATCH_BYTES, 8 << 20, 2 << 20):  # 0: the grouped path
        monkeypatch.setattr(cuda_ops.moe, "cublas_prefill", budget > 0)
        monkeypatch.setattr(linear_cuda, "SCRATCH_BYTES", budget or linear_cuda.SCRATCH_BYTES)
        y = run_moe(cuda_ops, case, x, experts, weights)
        errors.append(bound_error(y, ref, scale))
        assert errors[-1] <= RTOL_F16, (
            f"{gate_type}/{down_type} fused={fused} scratch {budget} B: error {errors[-1]:.2e}"
        )
    print(f"moe prefill {gate_type}/{down_type} fused={fused}: errors {errors}")


LOWBIT_TYPES = ["Q2_K", "Q3_K", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                "IQ1_M"]  # fmt: skip


@pytest.mark.parametrize("gate_type", LOWBIT_TYPES)
def test_moe_prefill_lowbit_types(cuda_ops, gate_type: str) -> None:
    """The low-bit formats of dynamic quants through MoE prefill (dequant.cu to f16 + batched
    products): 120 tokens x 4 of 16 experts, gate/up of one format and down of the next, fused
    and separate gate/up alternating."""
    i = LOWBIT_TYPES.index(gate_type)
    down_type = LOWBIT_TYPES[(i + 1) % len(LOWBIT_TYPES)]
    case = make_case(
        gate_type, down_type, 16, 256, 256, fused=i % 2 == 0, seed=300 + i, device="cuda"
    )
    rng = np.random.default_rng(300 + i)
    x = torch.from_numpy(rng.standard_normal((120, 256), dtype=np.float32))
    experts, weights = routing(120, 4, 16, rng)
    err = check_moe(cuda_ops, case, x, experts, weights, RTOL_F16)
    print(f"moe prefill {gate_type}/{down_type}: error {err:.2e}")


# ---- validation ----------------------------------------------------------------------------------


def test_views_are_accepted(cuda_ops) -> None:
    """Non-contiguous or misaligned x (model code passes views) is copied, not rejected."""
    rng = np.random.default_rng(1)
    w, _ = make_weight("Q8_0", 8, 64, rng, "cuda")
    x = torch.from_numpy(rng.standard_normal((3, 64), dtype=np.float32)).cuda()
    want = cuda_ops.linear.matmul(x, w)
    strided = torch.zeros(64, 3, device="cuda")
    strided.copy_(x.T)
    shifted = torch.zeros(3 * 64 + 1, device="cuda")
    shifted[1:].copy_(x.flatten())
    for view in (strided.T, shifted[1:].view(3, 64)):
        assert torch.equal(cuda_ops.linear.matmul(view, w), want)


def test_rejects_bad_input(cuda_ops) -> None:
    rng = np.random.default_rng(0)
    w, _ = make_weight("Q8_0", 4, 64, rng, "cuda")
    with pytest.raises(ValueError, match="cuda"):
        cuda_ops.linear.matmul(torch.zeros(2, 64), w)
    with pytest.raises(ValueError, match="out has shape"):
        cuda_ops.linear.dequantize(w, 0, 2, torch.empty(2, 32, device="cuda"))
    case = make_case("Q8_0", "Q8_0", 4, 64, 32, False, seed=1, device="cuda")
    experts, weights = routing(2, 2, 4, rng)
    with pytest.raises(ValueError, match="weights"):
        cuda_ops.moe.experts(torch.zeros(2, 64, device="cuda"), case.w, experts.cuda(), weights)
    cpu_case = make_case("Q8_0", "Q8_0", 4, 64, 32, False, seed=1)
    with pytest.raises(ValueError, match="uint8 on cuda"):
        cuda_ops.moe.experts(torch.zeros(2, 64, device="cuda"), cpu_case.w, experts, weights)
