"""The CUDA deltanet family (``DeltaNetCuda``) against the torch one (``DeltaNetTorch``, which
tests/cuda/test_deltanet_torch.py checks against the reference) and, for prefill, the CPU
reference itself. Shapes of the target models (qwen4exp: H_k 16, H_v 48, d 128, conv K 4,
C = 10240) and tiny odd ones (head dims not a multiple of 32). The helpers here (random tensors,
``close``, ``gpu_us``) serve the other GPU family tests too.

Tolerances: the kernels sum in another order than torch (and rsqrtf / expf differ from ATen's by
an ulp or two), so outputs agree to ~1e-6 relative.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference import deltanet

pytestmark = pytest.mark.gpu

QWEN4EXP = {"n_k_heads": 16, "n_v_heads": 48, "head_dim": 128}
ODD = [  # (H_k, H_v, d, K): tiny, a head dim that is not a multiple of 32, a non-default K
    (1, 3, 8, 2),
    (2, 4, 48, 3),
    (3, 3, 5, 4),
]


def dev() -> torch.device:
    return torch.device("cuda", 0)


def rand(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda") * scale


def close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    got, want = got.float().cpu(), want.float().cpu()
    diff = (got - want).abs()
    err = diff.max().item() if diff.numel() else 0.0
    where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if err else ()
    torch.testing.assert_close(
        got,
        want,
        atol=atol,
        rtol=rtol,
        msg=lambda m: f"{name} {list(got.shape)}: max abs err {err:.3g} at {where}\n{m}",
    )


# -- Gated DeltaNet decode ---------------------------------------------------------------------


def deltanet_inputs(b: int, hk: int, hv: int, d: int, k: int, n_slots: int, seed: int):
    c = (2 * hk + hv) * d
    x = rand(b, c, seed=seed)
    conv = rand(n_slots, k - 1, c, seed=seed + 1)
    weight = rand(c, k, seed=seed + 2, scale=0.5)
    ssm = rand(n_slots, hv, d, d, seed=seed + 3, scale=0.3)
    g = -F.softplus(rand(b, hv, seed=seed + 4))
    beta = torch.sigmoid(rand(b, hv, seed=seed + 5))
    slots = torch.randperm(n_slots, device=dev())[:b].to(torch.int32)
    return x, conv, weight, ssm, g, beta, slots


def check_decode(
    cuda_ops, torch_ops, b: int, hk: int, hv: int, d: int, k: int, n_slots: int
) -> None:
    heads = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": d, "eps": 1e-6}
    x, conv, weight, ssm, g, beta, slots = deltanet_inputs(b, hk, hv, d, k, n_slots, 20)
    conv_t, ssm_t = conv.clone(), ssm.clone()
    for step in range(3):  # chained steps: a wrong state write shows up in the next step
        y = cuda_ops.deltanet.conv_step(x, conv, slots, weight)
        y_t = torch_ops.deltanet.conv_step(x, conv_t, slots, weight)
        close(f"conv_step y (step {step})", y, y_t, 1e-5, 1e-5)
        close(f"conv state (step {step})", conv, conv_t, 1e-6, 0)
        o = cuda_ops.deltanet.step(y_t, g, beta, ssm, slots, **heads)
        o_t = torch_ops.deltanet.step(y_t, g, beta, ssm_t, slots, **heads)
        close(f"delta_step o (step {step})", o, o_t, 2e-5, 1e-4)
        close(f"ssm state (step {step})", ssm, ssm_t, 2e-5, 1e-4)
        x = x.roll(1, 1) * 0.9
    untouched = [s for s in range(n_slots) if s not in slots.tolist()]
    if untouched:
        u = torch.tensor(untouched, device=dev())
        _, start_conv, _, start_ssm, *_ = deltanet_inputs(b, hk, hv, d, k, n_slots, 20)
        assert torch.equal(conv[u], start_conv[u]), f"conv slots {untouched} changed"
        assert torch.equal(ssm[u], start_ssm[u]), f"ssm slots {untouched} changed"


@pytest.mark.parametrize(("b", "n_slots"), [(1, 5), (3, 5), (5, 5), (8, 10)])
def test_decode_qwen4exp(cuda_ops, torch_ops, b: int, n_slots: int) -> None:
    check_decode(cuda_ops, torch_ops, b, 16, 48, 128, 4, n_slots)


@pytest.mark.parametrize(("hk", "hv", "d", "k"), ODD)
def test_decode_odd(cuda_ops, torch_ops, hk: int, hv: int, d: int, k: int) -> None:
    check_decode(cuda_ops, torch_ops, 2, hk, hv, d, k, 3)


def test_decode_batch_invariant(cuda_ops) -> None:
    """A session's outputs and state are the same bits alone as beside seven others."""
    heads = dict(QWEN4EXP, eps=1e-6)
    x, conv, weight, ssm, g, beta, slots = deltanet_inputs(8, 16, 48, 128, 4, 10, 30)
    c1, s1 = conv.clone(), ssm.clone()
    o_all = cuda_ops.deltanet.step(
        cuda_ops.deltanet.conv_step(x, c1, slots, weight), g, beta, s1, slots, **heads
    )
    c2, s2 = conv.clone(), ssm.clone()
    one = slots[5:6]
    y1 = cuda_ops.deltanet.conv_step(x[5:6], c2, one, weight)
    o_one = cuda_ops.deltanet.step(y1, g[5:6], beta[5:6], s2, one, **heads)
    s = int(one.item())
    assert torch.equal(o_one[0], o_all[5]), "o differs alone vs batched"
    assert torch.equal(s2[s], s1[s]) and torch.equal(c2[s], c1[s]), "state differs"


def test_decode_graph_capture(cuda_ops, torch_ops) -> None:
    """conv_step, delta_step, gated_norm and rms_norm_rope captured into one CUDA graph replay
    to the same results as eager launches."""
    heads = dict(QWEN4EXP, eps=1e-6)
    x, conv, weight, ssm, g, beta, slots = deltanet_inputs(4, 16, 48, 128, 4, 5, 40)
    z, w = rand(4, 48 * 128, seed=41), rand(128, seed=42)
    q, qw = rand(4, 16, 256, seed=43), rand(256, seed=44)
    pos = torch.tensor([10, 200, 3000, 40000], dtype=torch.int32, device=dev())
    rope = {"n_rot": 64, "base": 1e7, "neox": True}

    def step(conv: torch.Tensor, ssm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = cuda_ops.deltanet.conv_step(x, conv, slots, weight)
        o = cuda_ops.deltanet.step(y, g, beta, ssm, slots, **heads)
        return cuda_ops.norm.gated(o, z, w, 1e-6, True), cuda_ops.rope.norm_apply(
            q, qw, 1e-6, pos, **rope
        )

    c_eager, s_eager = conv.clone(), ssm.clone()
    want = step(c_eager, s_eager)  # also compiles the kernels and caches inv_freq
    c_graph, s_graph = conv.clone(), ssm.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(c_graph.clone(), s_graph.clone())  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(c_graph, s_graph)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in (("gated", got[0], want[0]), ("rope", got[1], want[1])):
        assert torch.equal(a, b), f"graph replay differs: {name}"
    assert torch.equal(s_graph, s_eager) and torch.equal(c_graph, c_eager), "state differs"


# -- Gated DeltaNet prefill (the kernels; test_deltanet_prefill_kernel.py has the rest) ---------


def test_prefill_on_device_matches_reference(cuda_ops) -> None:
    """DeltaNetCuda.prefill (qwen4exp shapes, T not a multiple of the chunk) equals the CPU
    reference mix."""
    from mgserve.core.gguf.hparams_hybrid import HybridSpec
    from mgserve.core.reference.deltanet import DeltaNetWeights

    hk, hv, d, k, t = 16, 48, 128, 4, 100
    heads = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": d, "eps": 1e-6}
    qkv, conv, weight, ssm, _, _, _ = deltanet_inputs(t, hk, hv, d, k, 3, 50)
    g = -F.softplus(rand(t, hv, seed=55))
    beta = torch.sigmoid(rand(t, hv, seed=56))
    conv0, ssm0 = conv.cpu(), ssm.cpu()
    o = cuda_ops.deltanet.prefill(qkv, g, beta, conv, ssm, 1, weight, chunk=64, **heads)
    hp = HybridSpec(1, 1, 1, 0, True, (True,), True, k, d, hk, hv)
    zz = torch.zeros(1, 1)
    w = DeltaNetWeights(zz, zz, zz, weight.cpu(), zz, zz, zz, zz)
    want_o, want_conv, want_ssm = deltanet.mix(
        qkv.cpu()[None], g.cpu()[None], beta.cpu()[None], conv0[1:2], ssm0[1:2], w, hp, 1e-6, 64
    )
    close("prefill o", o, want_o[0], 1e-4, 1e-4)
    close("prefill conv", conv[1], want_conv[0], 1e-6, 0)
    close("prefill ssm", ssm[1], want_ssm[0], 1e-4, 1e-4)
    assert torch.equal(ssm[[0, 2]].cpu(), ssm0[[0, 2]]), "other slots changed"


# -- speed (printed; run with -s to see it) ------------------------------------------------------


def gpu_us(fn: Callable[[], object], reps: int = 50) -> float:
    """GPU microseconds per call of ``fn``: ``reps`` calls captured in a CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(4):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (4 * reps)


def test_decode_speed(cuda_ops) -> None:
    """conv_step + delta_step at qwen4exp shapes: prints microseconds and state bandwidth. Only a
    very loose bound is asserted (a regression by 10x), so the test never flakes."""
    heads = dict(QWEN4EXP, eps=1e-6)
    for b in (1, 4, 8):
        x, conv, weight, ssm, g, beta, slots = deltanet_inputs(b, 16, 48, 128, 4, 8, 60)
        y = cuda_ops.deltanet.conv_step(x, conv, slots, weight)
        conv_us = gpu_us(partial(cuda_ops.deltanet.conv_step, x, conv, slots, weight))
        delta_us = gpu_us(partial(cuda_ops.deltanet.step, y, g, beta, ssm, slots, **heads))
        state_bytes = 2 * b * 48 * 128 * 128 * 4
        print(
            f"\nB={b}: conv_step {conv_us:.2f} us, delta_step {delta_us:.2f} us "
            f"({state_bytes / delta_us / 1e3:.0f} GB/s of state)"
        )
        assert delta_us < 10 * (2.0 + state_bytes / 3e6), "delta_step far too slow"
