"""The token grid (math.cuh ``token_cta``, linear_tuning.token_launch): decode products of 2..8
tokens on the one-token kernels, one CTA per row block and token. Each token's output must be
bitwise the one-token launch on that token alone, and bitwise the t2/t4/t8 kernels' (``token_grid``
False), for every int8 format, the float matvecs and the hyper-connection kernels (odd row counts,
bias and residual, the fused combine). ``pytest -s -k timing`` prints the two layouts' times.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from mgserve.cuda.ops.linear_tuning import MAX_MATVEC_TOKENS, Q8Activations, token_launch
from mgserve.cuda.weights import upload_bytes
from tests.cuda.test_hc_torch import EPS, make_case, make_streams
from tests.cuda.test_linear_matvec import linear_cuda, random_tensor

gpu = pytest.mark.gpu
INT8 = ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]
TOKENS = range(2, MAX_MATVEC_TOKENS + 1)


def test_token_launch() -> None:
    """The grid: the one-token instance with one CTA per token; the tiles: the smallest NT."""
    assert [token_launch(n, True) for n in (1, 2, 5, 8)] == [(1, 1), (1, 2), (1, 5), (1, 8)]
    assert [token_launch(n, False) for n in (1, 2, 3, 5, 8)] == [
        (1, 1), (2, 1), (4, 1), (8, 1), (8, 1)
    ]  # fmt: skip


def weight(type_name: str, rows: int, k: int, seed: int):
    raw = random_tensor(type_name, rows, k, np.random.default_rng(seed))
    w = upload_bytes(f"w.{type_name}", type_name, (k, rows), raw)
    torch.cuda.synchronize()
    return w


def epilogue(n: int, rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, generator=g).cuda(), torch.randn(n, rows, generator=g).cuda()


def check_tokens(run, n: int, rows: int, label: str) -> None:
    """run(which, t0, t1) -> outputs of tokens t0..t1-1 from ``which`` ("grid" or "tiles") (a
    poisoned buffer, synced, on the CPU)."""
    grid, tiles = run("grid", 0, n), run("tiles", 0, n)
    assert grid.shape == (n, rows)
    assert torch.isfinite(grid).all(), f"{label} n={n}: unwritten or non-finite outputs"
    assert torch.equal(grid, tiles), f"{label} n={n}: token grid != t2/t4/t8 tiles"
    for t in range(n):
        alone = run("grid", t, t + 1)
        assert torch.equal(grid[t], alone[0]), f"{label} n={n}: token {t} differs from alone"


@pytest.fixture(scope="module")
def linear(kernels):
    ops = {"grid": linear_cuda(kernels), "tiles": linear_cuda(kernels, token_grid=False)}
    assert ops["grid"].q8.token_grid and not ops["tiles"].q8.token_grid
    return ops


def run_int8(ops, stream, w, xq, bias, res, which: str, t0: int, t1: int) -> torch.Tensor:
    out = torch.full((t1 - t0, w.rows), float("nan"), device="cuda")
    part = Q8Activations(xq.q[t0:t1], xq.d[t0:t1])
    r = res[t0:t1].contiguous()
    torch.cuda.synchronize()
    ops[which].q8.matvec(w, part, stream, out, bias, r)
    stream.sync()
    return out.cpu()


@gpu
@pytest.mark.parametrize("shape", [(37, 2560), (3, 512), (130, 10240)])
@pytest.mark.parametrize("type_name", INT8)
def test_int8(linear, stream, type_name: str, shape: tuple[int, int]) -> None:
    rows, k = shape
    w = weight(type_name, rows, k, rows + k)
    g = torch.Generator().manual_seed(rows)
    for n in TOKENS:
        x = torch.randn(n, k, generator=g).cuda()
        x[n - 1, 64:96] = 0.0  # an all-zero group
        bias, res = epilogue(n, rows, g)
        torch.cuda.synchronize()  # torch's stream made them; the kernels run on ``stream``
        xq = linear["grid"].q8.quantize(x, stream)
        run = partial(run_int8, linear, stream, w, xq, bias, res)
        check_tokens(run, n, rows, f"int8 {type_name} {rows}x{k}")


def run_float(ops, stream, w, x, bias, res, which: str, t0: int, t1: int) -> torch.Tensor:
    out = torch.full((t1 - t0, w.rows), float("nan"), device="cuda")
    r = res[t0:t1].contiguous()
    torch.cuda.synchronize()
    ops[which].matvec(w, x[t0:t1], stream, out=out, bias=bias, residual=r)
    stream.sync()
    return out.cpu()


@gpu
@pytest.mark.parametrize("shape", [(37, 2560), (5, 256)])
@pytest.mark.parametrize("type_name", ["F32", "BF16", "Q4_K"])
def test_float(linear, stream, type_name: str, shape: tuple[int, int]) -> None:
    rows, k = shape
    w = weight(type_name, rows, k, rows + k)
    g = torch.Generator().manual_seed(rows)
    for n in TOKENS:
        x = torch.randn(n, k, generator=g).cuda()
        bias, res = epilogue(n, rows, g)
        run = partial(run_float, linear, stream, w, x, bias, res)
        check_tokens(run, n, rows, f"float {type_name} {rows}x{k}")


def hc_cuda(kernels, token_grid: bool):
    from mgserve.cuda.dequantized import DenseWeights
    from mgserve.cuda.ops.hc import HCTorch
    from mgserve.cuda.ops.hc_cuda import HCCuda
    from mgserve.cuda.ops.linear import LinearTorch
    from mgserve.cuda.ops.linear_cuda import LinearCuda
    from mgserve.cuda.ops.norm import NormCuda

    dense = DenseWeights()
    linear = LinearCuda(kernels, LinearTorch(dense), token_grid=token_grid)
    return HCCuda(kernels, HCTorch(dense), linear, NormCuda(kernels), token_grid=token_grid)


HC_CASES = [  # (hc, d, r, down / up / inject formats)
    (4, 2560, 320, ("Q4_K", "Q5_0", "Q4_K")),  # a Q4_K file's hyper-connections
    (4, 2560, 320, ("Q6_K", "Q5_0", "Q6_K")),
    (4, 2560, 320, "BF16"),
    (3, 40, 24, "F32"),  # odd streams, rows and columns
    (4, 1536, 96, ("Q4_K", "Q4_1", "Q6_K")),  # 8 tokens stage a stream in parts, 1 token whole
]


def run_hc(ops, w, x, out, inj_prev, which: str, t0: int, t1: int) -> torch.Tensor:
    """combine_mix then mix: every output of both kernels, one row per token."""
    s = slice(t0, t1)
    args = (w.norm, w.down, w.up, w.inject, EPS)
    x_new, mixed, inj = ops[which].combine_mix(x[s], out[s], inj_prev[s], *args)
    mixed2, inj2 = ops[which].mix(x_new, *args)
    assert inj is not None and inj2 is not None
    torch.cuda.synchronize()
    return torch.cat([x_new.flatten(1), mixed, inj, mixed2, inj2], dim=1).cpu()


@gpu
@pytest.mark.parametrize("case", HC_CASES)
def test_hc(kernels, case: tuple) -> None:
    """The fused combine (hc_down's sums of squares and x_new), hc_up's inject, and the plain
    mix."""
    hc, d, r, types = case
    w = make_case(hc, d, r, types, seed=d + r, device="cuda")
    ops = {"grid": hc_cuda(kernels, True), "tiles": hc_cuda(kernels, False)}
    g = torch.Generator().manual_seed(d)
    for n in TOKENS:
        x = make_streams(n, hc, d, seed=n).cuda()
        out = torch.randn(n, d, generator=g).cuda()
        inj_prev = (torch.rand(n, hc, generator=g) * 2).cuda()
        run = partial(run_hc, ops, w, x, out, inj_prev)
        check_tokens(run, n, hc * d + 2 * (d + hc), f"hc {case}")


def time_us(fn, iters: int = 200) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


@gpu
@pytest.mark.parametrize("shape", [(2560, 2560), (512, 2560), (10240, 2560)])
def test_timing(linear, shape: tuple[int, int]) -> None:
    """Prints one launch's time, 1 token and 5 on the grid and on the tiles (Q4_K int8, F32)."""
    rows, k = shape
    for type_name, int8 in (("Q4_K", True), ("F32", False)):
        w = weight(type_name, rows, k, 7)
        x = torch.randn(5, k, device="cuda")
        xq = linear["grid"].q8.quantize(x) if int8 else None
        out = torch.empty(5, rows, device="cuda")
        times = {}
        for which in ("grid", "tiles"):
            for n in (1, 5):
                part = None if xq is None else Q8Activations(xq.q[:n], xq.d[:n])
                call = partial(
                    linear[which].matvec, w, x[:n], None, out=out[:n], int8=int8, xq=part
                )
                times[which, n] = time_us(call)
        print(
            f"{type_name}{' int8' if int8 else ''} {rows}x{k}: 1 token {times['grid', 1]:.1f} us; "
            f"5 tokens grid {times['grid', 5]:.1f} us, tiles {times['tiles', 5]:.1f} us"
        )
