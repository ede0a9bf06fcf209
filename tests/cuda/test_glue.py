"""The kernels that took over a decode step's glue against their torch versions (which
test_glue_torch.py checks against the reference) on the same GPU tensors: the linear and MoE
epilogues (bias, residual), shared int8 activations, the shared expert's gated sum, DeltaNet
gates, the gated norm's head order, the sigmoid gate on strided halves, the embedding gather.

Where a kernel only adds an epilogue to an existing product, the check is bitwise against the
plain product plus the same torch additions (fp32 adds round the same way on both sides). Where
it computes something new, the tolerance covers expf / log1pf ulps and another summation order
of a dot product: 1e-5 relative. Sizes: N = 1 and 8 (the decode buckets' ends), 3 (a padded
bucket), odd widths (scalar paths) and multiples of 4 (float4 paths).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cuda.test_deltanet import close, rand
from tests.cuda.test_moe_torch import make_weight

pytestmark = pytest.mark.gpu

N_TOKENS = (1, 3, 8)


@pytest.mark.parametrize("n", (*N_TOKENS, 20))
@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", "F16"])
def test_linear_epilogue_is_the_plain_product_plus_adds(cuda_ops, cuda_ops_int8, n: int,
                                                        type_name: str) -> None:  # fmt: skip
    """matmul(bias, residual) == residual + (matmul + bias) bitwise, fp32 and int8 kernels
    (F16 has no int8 kernel: the fp32 one runs); N = 20 is the prefill path (torch adds)."""
    rng = np.random.default_rng(11)
    w, _ = make_weight(type_name, 37, 512, rng, "cuda")  # 37 rows: a partial last CTA
    x, b, r = rand(n, 512, seed=1), rand(37, seed=2), rand(n, 37, seed=3)
    for ops in (cuda_ops, cuda_ops_int8):
        plain = ops.linear.matmul(x, w)
        got = ops.linear.matmul(x, w, bias=b, residual=r)
        assert torch.equal(got, r + (plain + b)), f"{type_name} N={n} int8={ops.linear.int8}"
        assert torch.equal(ops.linear.matmul(x, w, bias=b), plain + b)


@pytest.mark.parametrize("n", N_TOKENS)
def test_shared_int8_activations(cuda_ops, cuda_ops_int8, n: int) -> None:
    """linear.quantize(x) once, read by several products: the same bits as each product
    rounding x itself; None where nothing would read it (fp32 mode, N > 8)."""
    rng = np.random.default_rng(12)
    ws = [make_weight(t, 48, 512, rng, "cuda")[0] for t in ("Q4_K", "Q6_K", "Q5_0")]
    x = rand(n, 512, seed=4)
    xq = cuda_ops_int8.linear.quantize(x)
    assert xq is not None and xq.n_tok == n
    for w in ws:
        assert torch.equal(
            cuda_ops_int8.linear.matmul(x, w, xq=xq), cuda_ops_int8.linear.matmul(x, w)
        )
    assert cuda_ops.linear.quantize(x) is None
    assert cuda_ops_int8.linear.quantize(rand(9, 512, seed=5)) is None


@pytest.mark.parametrize("n", N_TOKENS)
def test_moe_residual_and_shared_xq(cuda_ops, cuda_ops_int8, n: int) -> None:
    """experts(residual=x) == x + experts bitwise (the down kernels' epilogue), fp32 and int8;
    int8 with the caller's xq gives the same bits as rounding x inside."""
    from mgserve.cuda.ops.moe import ExpertWeights

    rng = np.random.default_rng(13)
    e, ff, d = 4, 64, 256
    gate, _ = make_weight("Q4_K", e * ff, d, rng, "cuda")
    up, _ = make_weight("Q4_K", e * ff, d, rng, "cuda")
    down, _ = make_weight("Q8_0", e * d, ff, rng, "cuda")
    w = ExpertWeights(gate, up, None, down, e, ff)
    h, x = rand(n, d, seed=6), rand(n, d, seed=7)
    ids = torch.randint(0, e, (n, 2), device="cuda", dtype=torch.int32)
    wts = torch.rand(n, 2, device="cuda")
    for ops in (cuda_ops, cuda_ops_int8):
        plain = ops.moe.experts(h, w, ids, wts)
        assert torch.equal(ops.moe.experts(h, w, ids, wts, residual=x), x + plain)
    xq = cuda_ops_int8.linear.quantize(h)
    want = cuda_ops_int8.moe.experts(h, w, ids, wts)
    assert torch.equal(cuda_ops_int8.moe.experts(h, w, ids, wts, xq=xq), want)


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("d", [2048, 77])
def test_add_shared(cuda_ops, torch_ops, n: int, d: int) -> None:
    """residual + (routed + shared * sigmoid(h . gate)) (the dot product in another order than
    torch's sum: 1e-5 relative), ungated and without residual too."""
    routed, shared, h = rand(n, d, seed=8), rand(n, d, seed=9), rand(n, d, seed=10)
    gate, x = rand(d, seed=11, scale=0.05), rand(n, d, seed=12)
    for args in ((gate, x), (gate, None), (None, x), (None, None)):
        got = cuda_ops.moe.add_shared(routed, shared, h, *args)
        want = torch_ops.moe.add_shared(routed, shared, h, *args)
        close(f"add_shared gate={args[0] is not None} res={args[1] is not None}", got, want,
              1e-5, 1e-5)  # fmt: skip


@pytest.mark.parametrize("d", [2560, 2048, 77])
def test_add_shared_in_parts_is_one_cta_a_row(cuda_ops, monkeypatch, d: int) -> None:
    """A decode step's rows cut into parts (a CTA each, every one summing the gate itself) give
    the bits of one CTA a row, for 1..8 tokens; a prompt's rows (9+) take one CTA a row."""
    for n in (1, 3, 8, 9):
        routed, shared, h = rand(n, d, seed=13), rand(n, d, seed=14), rand(n, d, seed=15)
        gate, x = rand(d, seed=16, scale=0.05), rand(n, d, seed=17)
        for args in ((gate, x), (None, None)):
            monkeypatch.setattr(cuda_ops.moe, "shared_parts", True)
            got = cuda_ops.moe.add_shared(routed, shared, h, *args)
            monkeypatch.setattr(cuda_ops.moe, "shared_parts", False)
            want = cuda_ops.moe.add_shared(routed, shared, h, *args)
            assert torch.equal(got, want), f"d={d} n={n} gate={args[0] is not None}"


def test_add_shared_past_one_launchs_rows(cuda_ops) -> None:
    """More rows than a launch's grid y holds (65535) go in blocks: every row is its result
    alone, bitwise, on both sides of a block's edge."""
    n, d = 65537, 77
    routed, shared, h = rand(n, d, seed=18), rand(n, d, seed=19), rand(n, d, seed=20)
    gate, x = rand(d, seed=21, scale=0.05), rand(n, d, seed=22)
    got = cuda_ops.moe.add_shared(routed, shared, h, gate, x)
    for r in (0, 65534, 65535, 65536):
        one = cuda_ops.moe.add_shared(routed[r : r + 1], shared[r : r + 1], h[r : r + 1],
                                      gate, x[r : r + 1])  # fmt: skip
        assert torch.equal(got[r : r + 1], one), f"row {r}"


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("hv", [48, 5])
def test_deltanet_gates(cuda_ops, torch_ops, n: int, hv: int) -> None:
    """g, beta from the column halves of one [N, 2 H_v] product and from two tensors; inputs
    spread past softplus's threshold (20) and deep into sigmoid's tails."""
    ba = rand(n, 2 * hv, seed=13, scale=12.0)
    dt_bias, a = rand(hv, seed=14, scale=4.0), -rand(hv, seed=15).abs()
    for b, alpha in ((ba[:, :hv], ba[:, hv:]), (ba[:, :hv].contiguous(), rand(n, hv, seed=16))):
        got = cuda_ops.deltanet.gates(b, alpha, dt_bias, a)
        want = torch_ops.deltanet.gates(b, alpha, dt_bias, a)
        close("g", got[0], want[0], 1e-6, 1e-5)
        close("beta", got[1], want[1], 1e-6, 1e-5)


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("dv", [128, 5])
def test_gated_norm_head_order_and_rms_residual(cuda_ops, torch_ops, n: int, dv: int) -> None:
    """The gated norm with ``heads`` is the plain kernel's output with heads moved (bitwise) and
    matches the torch version; rms(residual=r) == r + rms bitwise (float4 and scalar paths)."""
    hv = 6
    o, z, w = rand(n, hv, dv, seed=17), rand(n, hv * dv, seed=18), rand(dv, seed=19)
    heads = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32, device="cuda")
    plain = cuda_ops.norm.gated(o, z, w, 1e-6, True).view(n, hv, dv)
    got = cuda_ops.norm.gated(o, z, w, 1e-6, True, heads)
    assert torch.equal(got.view(n, hv, dv)[:, heads.long()], plain)
    close("gated heads", got, torch_ops.norm.gated(o, z, w, 1e-6, True, heads), 1e-5, 1e-5)
    x, r = rand(n, 3, dv, seed=20), rand(n, 3, dv, seed=21)
    assert torch.equal(cuda_ops.norm.rms(x, w, 1e-6, residual=r), r + cuda_ops.norm.rms(x, w, 1e-6))


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("dh", [128, 5])
def test_sigmoid_mul_on_gate_halves(cuda_ops, torch_ops, n: int, dh: int) -> None:
    """The attention gate read in place from per-head [q | gate] rows of one projection."""
    q, out = rand(n, 4, 2 * dh, seed=22, scale=4.0), rand(n, 4, dh, seed=23)
    gate = q[..., dh:]
    got = cuda_ops.act.sigmoid_mul(gate, out)
    close("sigmoid_mul", got, torch_ops.act.sigmoid_mul(gate, out), 1e-6, 1e-6)


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("d", [64, 7])
def test_embed_gather(cuda_ops, torch_ops, n: int, d: int) -> None:
    """Rows by int64 and int32 ids, scaled, into 0 or 4 streams: bitwise the torch version."""
    table = rand(100, d, seed=24)
    ids = torch.randint(0, 100, (n,), device="cuda")
    for idx in (ids, ids.to(torch.int32)):
        for streams, scale in ((0, 1.0), (4, 1.0), (0, 45.254833995939045)):
            got = cuda_ops.embed.gather(table, idx, streams=streams, scale=scale)
            want = torch_ops.embed.gather(table, idx, streams=streams, scale=scale)
            assert torch.equal(got, want), f"embed d={d} streams={streams} scale={scale}"
