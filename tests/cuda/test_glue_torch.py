"""The torch versions of the ops that took over a decode step's glue (bench glue) against the
reference path's arithmetic, on the CPU (CI): linear bias / residual, the MoE residual and shared
expert, DeltaNet gates, the gated norm's head order, the attention's sigmoid gate, the embedding
gather, and the load-time fusion of projections. Most must be bitwise the reference's (the same
torch ops in the same order); tolerances are stated where not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference import ops, rowwise
from mgserve.core.reference.moe import MoeWeights, shared_expert
from mgserve.cuda.backend import Backend, torch_backend
from mgserve.cuda.checks import rows_view
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.loader import fuse_rows
from mgserve.cuda.ops.moe import ExpertWeights
from tests.cuda.test_deltanet_torch import close, gen
from tests.cuda.test_moe_torch import make_weight


@pytest.fixture(scope="module")
def so() -> Backend:
    return torch_backend()


def test_linear_bias_and_residual(so: Backend) -> None:
    """residual + (x @ W^T + b), the reference's ``x + ops.linear(h, w, b)``, bitwise."""
    rng = np.random.default_rng(1)
    w, _ = make_weight("Q4_K", 24, 256, rng)
    dense = DenseWeights()(w)
    g = gen(1)
    x, b, r = torch.randn(3, 256, generator=g), torch.randn(24, generator=g), torch.randn(3, 24)
    close("bias", so.linear.matmul(x, w, bias=b), ops.linear(x, dense, b), atol=0)
    close("residual", so.linear.matmul(x, w, bias=b, residual=r), r + ops.linear(x, dense, b), 0)
    assert so.linear.quantize(x) is None  # the torch version keeps x in fp32
    with pytest.raises(ValueError, match="residual must be float32"):
        so.linear.matmul(x, w, residual=r[:, :5])


def test_fuse_rows_stacks_projections() -> None:
    """One weight of the rows of several (same format): its product is their products side by
    side; different formats stay apart."""
    rng = np.random.default_rng(2)
    a, _ = make_weight("Q8_0", 5, 64, rng)
    b, _ = make_weight("Q8_0", 3, 64, rng)
    c, _ = make_weight("Q4_0", 3, 64, rng)
    (ab,) = fuse_rows(a, b)
    dense = DenseWeights()
    assert ab.rows == 8 and ab.k == 64
    close("fused", dense(ab), torch.cat((dense(a), dense(b))), atol=0)
    assert fuse_rows(a, c) == [a, c]


def test_moe_residual_and_shared(so: Backend) -> None:
    """experts(residual=x) is x + experts; add_shared is the reference's routed + shared_expert
    (sigmoid(h . gate) scaling the shared expert's output), then the residual."""
    g = gen(3)
    n, d, ff = 3, 64, 32
    h, routed, x = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(n, d)
    wg, wu, wd = (torch.randn(*s, generator=g) * 0.2 for s in ((ff, d), (ff, d), (d, ff)))
    gate = torch.randn(d, generator=g) * 0.3
    mw = MoeWeights(
        router=torch.zeros(1, d), gate=wg[None], up=wu[None], down=wd[None],
        shexp_gate_inp=gate, shexp_gate=wg, shexp_up=wu, shexp_down=wd,
    )  # fmt: skip
    shared = ops.linear(rowwise.silu(ops.linear(h, wg)) * ops.linear(h, wu), wd)
    want = routed + shared_expert(h, mw)
    close("add_shared", so.moe.add_shared(routed, shared, h, gate), want, atol=0)
    close("add_shared + x", so.moe.add_shared(routed, shared, h, gate, x), x + want, atol=0)
    close("ungated", so.moe.add_shared(routed, shared, h, None), routed + shared, atol=0)
    rng = np.random.default_rng(4)
    wgt, _ = make_weight("Q8_0", 2 * ff, d, rng)
    wdn, _ = make_weight("Q8_0", 2 * d, ff, rng)
    ew = ExpertWeights(wgt, wgt, None, wdn, 2, ff)
    ids, wts = torch.tensor([[1, 0]] * n), torch.rand(n, 2, generator=g)
    plain = so.moe.experts(h, ew, ids, wts)
    close("experts + x", so.moe.experts(h, ew, ids, wts, residual=x), x + plain, atol=0)


def test_deltanet_gates(so: Backend) -> None:
    """g and beta from the two projections (column halves of one, as loaded) as
    ``deltanet.project`` computes them from qwen3next's ssm_ba, bitwise."""
    g = gen(5)
    n, hk, r = 3, 2, 3
    hv = hk * r
    ba_file = torch.randn(n, hk, 2 * r, generator=g) * 3  # per key head [beta (r) | alpha (r)]
    dt_bias, a = torch.randn(hv, generator=g), -torch.rand(hv, generator=g)
    want_beta = rowwise.sigmoid(ba_file[..., :r].reshape(n, hv))  # deltanet.project's lines
    want_g = rowwise.softplus(ba_file[..., r:].reshape(n, hv) + dt_bias) * a
    fused = torch.cat((ba_file[..., :r].reshape(n, hv), ba_file[..., r:].reshape(n, hv)), 1)
    got_g, got_beta = so.deltanet.gates(fused[:, :hv], fused[:, hv:], dt_bias, a)
    close("g", got_g, want_g, atol=0)
    close("beta", got_beta, want_beta, atol=0)
    assert got_g.is_contiguous() and got_beta.is_contiguous()
    with pytest.raises(ValueError, match="dt_bias"):
        so.deltanet.gates(fused[:, :hv], fused[:, hv:], dt_bias[:-1], a)


def test_gated_norm_head_order(so: Backend) -> None:
    """heads[j] = where head j goes: the reordered output is the plain one with its heads moved
    (qwen4exp's value heads back in ssm_out's order), bitwise."""
    g = gen(6)
    n, hv, dv = 2, 6, 8
    o, z, w = (
        torch.randn(n, hv, dv, generator=g),
        torch.randn(n, hv * dv, generator=g),
        torch.rand(dv),
    )
    heads = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    plain = so.norm.gated(o, z, w, 1e-6, True).view(n, hv, dv)
    got = so.norm.gated(o, z, w, 1e-6, True, heads).view(n, hv, dv)
    close("heads", got[:, heads.long()], plain, atol=0)
    want = ops.rms_norm(o, w, 1e-6) * rowwise.sigmoid(z).view(n, hv, dv)
    close("plain", plain, want, atol=0)


def test_rms_residual(so: Backend) -> None:
    g = gen(7)
    x, r, w = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.rand(40)
    close("rms + residual", so.norm.rms(x, w, 1e-6, residual=r), r + ops.rms_norm(x, w, 1e-6), 0)


def test_sigmoid_mul_on_gate_halves(so: Backend) -> None:
    """The attention gate as it is read (per head [q | gate] of one projection): the reference's
    out * rowwise.sigmoid(gate) on the contiguous gate, bitwise (head dim a multiple of 64)."""
    g = gen(8)
    n, h, dh = 3, 4, 64
    q = torch.randn(n, h, 2 * dh, generator=g) * 3
    out = torch.randn(n, h * dh, generator=g)
    gate = q[..., dh:]  # [N, H, Dh] view
    want = out * rowwise.sigmoid(gate.reshape(n, h * dh))
    got = so.act.sigmoid_mul(gate, out.view(n, h, dh)).view(n, -1)
    close("sigmoid_mul", got, want, atol=0)
    close("plain", so.act.sigmoid_mul(out, out), out * torch.sigmoid(out), atol=1e-6)


def test_rows_view_reads_strided_heads_in_place() -> None:
    """[N, H, D] slices of [N, H, 2 D] are rows of D, 2 D apart (no copy); a transposed tensor is
    copied."""
    q = torch.randn(3, 4, 16)
    rows, n, stride = rows_view(q[..., 8:], 8)
    assert (n, stride) == (12, 16) and rows.data_ptr() == q[..., 8:].data_ptr()
    t = torch.randn(8, 5).T
    rows, n, stride = rows_view(t, 8)
    assert (n, stride) == (5, 8) and rows.is_contiguous()


def test_embed_gather(so: Backend) -> None:
    table = torch.randn(50, 12, generator=gen(9))
    ids = torch.tensor([7, 0, 49, 7])
    close("rows", so.embed.gather(table, ids), table[ids], atol=0)
    close("scaled", so.embed.gather(table, ids, scale=3.5), table[ids] * 3.5, atol=0)
    streams = so.embed.gather(table, ids.to(torch.int32), streams=3)
    close("streams", streams, table[ids][:, None, :].repeat(1, 3, 1), atol=0)
    assert F.mse_loss(streams[:, 1], table[ids]).item() == 0.0
