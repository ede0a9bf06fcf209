"""The int8 tensor-core matvec of 2..8 tokens (matvec_q8mma_* in matvec_q8.cu) against the
one-token kernel: each token's output row must be bitwise the one-token kernel's on that token
alone (batch invariance) and bitwise the dp4a kernels' of several tokens, and within
test_linear_matvec_q8's bound of the float64 product of the same int8 activations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgserve.cuda.ops.linear_tuning import Q8Activations
from mgserve.cuda.weights import upload_bytes
from tests.cuda.test_linear_matvec import linear_cuda, random_tensor, reference_weight
from tests.cuda.test_linear_matvec_q8 import RTOL_Q8

pytestmark = pytest.mark.gpu

INT8 = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]
ROWS = 37  # odd, not a multiple of the 8 rows per CTA


@pytest.fixture(scope="module")
def mma(kernels):
    ops = linear_cuda(kernels, q8_mma=True)
    assert ops.q8.mma
    return ops


@pytest.fixture(scope="module")
def dp4a(kernels):
    ops = linear_cuda(kernels)
    assert not ops.q8.mma, "dp4a is the default for 2..8 tokens (the faster on the H200)"
    return ops


def run(ops, stream, w, xq: Q8Activations, **epilogue) -> torch.Tensor:
    out = torch.full((xq.n_tok, w.rows), float("nan"), device="cuda")  # poisoned
    torch.cuda.synchronize()  # the fill (torch's stream) before the kernel on ``stream``
    ops.q8.matvec(w, xq, stream, out, **epilogue)
    stream.sync()
    return out.cpu()


def token(xq: Q8Activations, t: int) -> Q8Activations:
    return Q8Activations(xq.q[t : t + 1], xq.d[t : t + 1])


def extreme(type_name: str, raw: np.ndarray) -> np.ndarray:
    """``raw`` with every quant and scale at the end of its range that makes the integer sums
    largest (the exact int -> float conversion's bound, gguf_blocks_q8.cuh i2f)."""
    raw = raw.copy()
    if type_name == "Q4_K":  # all scales and mins 63, all quants 15
        b = raw.reshape(-1, 144)
        b[:, 4:16] = 0xFF
        b[:, 16:] = 0xFF
    elif type_name == "Q6_K":  # all scales -128, all quants -32
        b = raw.reshape(-1, 210)
        b[:, :192] = 0
        b[:, 192:208] = 0x80
    elif type_name == "Q5_0":  # all quants -16
        b = raw.reshape(-1, 22)
        b[:, 2:] = 0
    else:  # Q8_0: all quants -128
        b = raw.reshape(-1, 34)
        b[:, 2:] = 0x80
    return raw


def check_tokens(mma, dp4a, stream, type_name: str, raw: np.ndarray, k: int, x: torch.Tensor):
    w = upload_bytes(f"w.{type_name}", type_name, (k, ROWS), raw)
    torch.cuda.synchronize()
    xq = mma.q8.quantize(x.cuda(), stream)
    stream.sync()
    y = run(mma, stream, w, xq)
    assert torch.isfinite(y).all(), f"{type_name}: unwritten or non-finite outputs"
    for t in range(x.shape[0]):
        alone = run(mma, stream, w, token(xq, t))
        assert torch.equal(y[t], alone[0]), f"{type_name} k={k} n={x.shape[0]}: token {t} differs"
    assert torch.equal(y, run(dp4a, stream, w, xq)), f"{type_name} k={k}: mma != dp4a"
    q, d = xq.q.cpu().double(), xq.d.cpu().double()
    xdeq = (q.reshape(x.shape[0], -1, 32) * d[..., None]).reshape(x.shape[0], k)
    wref = reference_weight(type_name, ROWS, k, raw).double()
    err = ((y.double() - xdeq @ wref.T).abs() / (xdeq.abs() @ wref.abs().T).clamp_min(1e-30)).max()
    assert err.item() <= RTOL_Q8, f"{type_name} k={k}: error vs float reference {err.item():.2e}"


@pytest.mark.parametrize("k", [2560, 10240])
@pytest.mark.parametrize("type_name", INT8)
def test_tokens_match_one_token_kernel(mma, dp4a, stream, type_name: str, k: int) -> None:
    rng = np.random.default_rng(k + len(type_name))
    raw = random_tensor(type_name, ROWS, k, rng)
    for n_tok in range(2, 9):
        x = torch.from_numpy(rng.standard_normal((n_tok, k), dtype=np.float32))
        x[n_tok - 1, 64:96] = 0.0  # an all-zero group
        check_tokens(mma, dp4a, stream, type_name, raw, k, x)


@pytest.mark.parametrize("type_name", INT8)
def test_extreme_sums(mma, dp4a, stream, type_name: str) -> None:
    k = 512
    raw = extreme(type_name, random_tensor(type_name, ROWS, k, np.random.default_rng(3)))
    x = torch.ones(5, k)  # every activation quantizes to 127
    x[1] = -1.0
    check_tokens(mma, dp4a, stream, type_name, raw, k, x)


@pytest.mark.parametrize("type_name", INT8)
def test_short_rows_and_epilogue(mma, stream, type_name: str) -> None:
    """One block per row, fewer rows than a CTA's 8, bias and residual: still each token alone."""
    rng = np.random.default_rng(11)
    k = 256 if type_name in ("Q4_K", "Q6_K") else 32
    rows = 3
    raw = random_tensor(type_name, rows, k, rng)
    w = upload_bytes(f"w.{type_name}", type_name, (k, rows), raw)
    x = torch.from_numpy(rng.standard_normal((6, k), dtype=np.float32)).cuda()
    bias = torch.randn(rows, device="cuda")
    res = torch.randn(6, rows, device="cuda")
    torch.cuda.synchronize()
    xq = mma.q8.quantize(x, stream)
    y = run(mma, stream, w, xq, bias=bias, residual=res)
    for t in range(6):
        alone = run(mma, stream, w, token(xq, t), bias=bias, residual=res[t : t + 1].contiguous())
        assert torch.equal(y[t], alone[0]), f"{type_name}: token {t} differs"


def time_launches(ops, stream, w, xq: Q8Activations, out: torch.Tensor, iters: int = 200) -> float:
    """Microseconds per launch, eager, after a warm-up."""
    ts = torch.cuda.ExternalStream(int(stream.handle))
    for _ in range(3):
        ops.q8.matvec(w, xq, stream, out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(ts)
    for _ in range(iters):
        ops.q8.matvec(w, xq, stream, out)
    end.record(ts)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


@pytest.mark.parametrize("type_name", INT8)
def test_timing_one_vs_five_tokens(mma, dp4a, stream, type_name: str) -> None:
    """Prints the time of a 10240 x 2560 product for 1 token and 5 (mma and dp4a); asserts that
    the 5 tokens' outputs agree between the two kernels."""
    rows, k = 10240, 2560
    raw = random_tensor(type_name, rows, k, np.random.default_rng(5))
    w = upload_bytes(f"w.{type_name}", type_name, (k, rows), raw)
    x = torch.randn(5, k, device="cuda")
    torch.cuda.synchronize()
    xq = mma.q8.quantize(x, stream)
    out1 = torch.empty(1, rows, device="cuda")
    a, b = torch.empty(5, rows, device="cuda"), torch.empty(5, rows, device="cuda")
    one = time_launches(mma, stream, w, token(xq, 0), out1)
    t_mma = time_launches(mma, stream, w, xq, a)
    t_dp4a = time_launches(dp4a, stream, w, xq, b)
    stream.sync()
    assert torch.equal(a, b)
    print(
        f"matvec int8 {type_name} {rows}x{k}: 1 token {one:.1f} us; 5 tokens mma {t_mma:.1f} us, "
        f"dp4a {t_dp4a:.1f} us"
    )
