"""The torch deltanet family (``DeltaNetTorch``, and the gated norm of the norm family) against
the reference path on the CPU (runs in CI). The DeltaNet ops must reproduce
``reference.deltanet.mix`` / ``output``: decode steps (conv_step + delta_step) for a batch of slots,
one-session prefill for any T and chunk size, prompts split across calls, decode after prefill,
and untouched slots left alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.reference import deltanet
from mgserve.core.reference.deltanet import DeltaNetWeights
from mgserve.cuda.backend import Backend, torch_backend
from mgserve.cuda.ops import deltanet_chunked
from mgserve.cuda.ops.deltanet_chunked import delta_rule_chunked_device

HK, HV, D, K, EPS = 2, 6, 16, 4, 1e-6
C = (2 * HK + HV) * D
N_SLOTS = 5
HEADS = {"n_k_heads": HK, "n_v_heads": HV, "head_dim": D, "eps": EPS}


@pytest.fixture(scope="module")
def so() -> Backend:
    return torch_backend()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    torch.testing.assert_close(
        got, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: max abs err {err:.3g}\n{m}"
    )


# -- Gated DeltaNet -----------------------------------------------------------------------------


def spec() -> HybridSpec:
    return HybridSpec(
        n_expert=1,
        n_expert_used=1,
        n_ff_exp=1,
        n_ff_shexp=0,
        norm_topk=True,
        recurrent=(True,),
        attn_gated=True,
        ssm_conv=K,
        ssm_head_dim=D,
        ssm_k_heads=HK,
        ssm_v_heads=HV,
    )


def weights(conv_w: torch.Tensor, norm: torch.Tensor | None = None, sigmoid: bool = False):
    z = torch.zeros(1, 1)
    return DeltaNetWeights(
        qkv=z,
        z=z,
        ba=z,
        conv=conv_w,
        dt_bias=z,
        a=z,
        norm=norm if norm is not None else z,
        out=torch.eye(HV * D),  # output() then returns the gated norm exactly
        sigmoid_gate=sigmoid,
    )


def seq(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [t, C], g [t, HV] (log decay <= 0), beta [t, HV] of one session."""
    g = gen(seed)
    return (
        torch.randn(t, C, generator=g),
        -F.softplus(torch.randn(t, HV, generator=g)),
        torch.sigmoid(torch.randn(t, HV, generator=g)),
    )


def states(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv [N_SLOTS, K-1, C], ssm [N_SLOTS, HV, D, D] (non-zero), conv weight [C, K]."""
    g = gen(seed)
    return (
        torch.randn(N_SLOTS, K - 1, C, generator=g),
        torch.randn(N_SLOTS, HV, D, D, generator=g) * 0.3,
        torch.randn(C, K, generator=g) * 0.5,
    )


def test_decode_step_matches_mix(so: Backend) -> None:
    """conv_step + delta_step for 3 of 5 slots == mix(T = 1) per session; others untouched."""
    conv, ssm, cw = states(10)
    conv0, ssm0 = conv.clone(), ssm.clone()
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)
    qkv, g, beta = seq(3, 11)  # one token of each of 3 sessions
    y = so.deltanet.conv_step(qkv, conv, slots, cw)
    o = so.deltanet.step(y, g, beta, ssm, slots, **HEADS)  # type: ignore[arg-type]
    assert o.shape == (3, HV, D)
    for b, s in enumerate(slots.tolist()):
        want_o, want_conv, want_ssm = deltanet.mix(
            qkv[b, None, None], g[b, None, None], beta[b, None, None],
            conv0[s, None], ssm0[s, None], weights(cw), spec(), EPS,
        )  # fmt: skip
        close(f"o session {b}", o[b], want_o[0, 0], atol=1e-6)
        close(f"conv slot {s}", conv[s], want_conv[0], atol=0)
        close(f"ssm slot {s}", ssm[s], want_ssm[0], atol=1e-6)
    for s in (1, 2):
        assert torch.equal(conv[s], conv0[s]) and torch.equal(ssm[s], ssm0[s]), f"slot {s} changed"


def test_decode_batch_invariant(so: Backend) -> None:
    """A session's decode step gives the same bits alone as beside two others."""
    conv, ssm, cw = states(12)
    qkv, g, beta = seq(3, 13)
    slots = torch.tensor([2, 1, 4], dtype=torch.int32)
    c1, s1 = conv.clone(), ssm.clone()
    y = so.deltanet.conv_step(qkv, c1, slots, cw)
    o_all = so.deltanet.step(y, g, beta, s1, slots, **HEADS)  # type: ignore[arg-type]
    c2, s2 = conv.clone(), ssm.clone()
    one = slots[1:2]
    y1 = so.deltanet.conv_step(qkv[1:2], c2, one, cw)
    o_one = so.deltanet.step(y1, g[1:2], beta[1:2], s2, one, **HEADS)  # type: ignore[arg-type]
    close("o alone vs batched", o_one[0], o_all[1], atol=1e-6)
    close("ssm alone vs batched", s2[1], s1[1], atol=1e-6)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_gated_norm(so: Backend, sigmoid: bool) -> None:
    g = gen(14)
    o = torch.randn(5, HV, D, generator=g)
    z = torch.randn(5, HV * D, generator=g) * 3
    w = torch.randn(D, generator=g)
    want = deltanet.output(o, z.view(5, HV, D), weights(torch.zeros(C, K), w, sigmoid), EPS)
    close("gated_norm", so.norm.gated(o, z, w, EPS, sigmoid), want, atol=1e-6)


@pytest.mark.parametrize(
    ("t", "chunk"), [(1, 64), (5, 64), (64, 64), (100, 64), (130, 16), (37, 7)]
)
def test_prefill_matches_mix(so: Backend, t: int, chunk: int) -> None:
    conv, ssm, cw = states(20)
    conv0, ssm0 = conv.clone(), ssm.clone()
    qkv, g, beta = seq(t, 21)
    o = so.deltanet.prefill(qkv, g, beta, conv, ssm, 2, cw, chunk=chunk, **HEADS)  # type: ignore[arg-type]
    want_o, want_conv, want_ssm = deltanet.mix(
        qkv[None], g[None], beta[None], conv0[2:3], ssm0[2:3], weights(cw), spec(), EPS, chunk
    )
    close("o", o, want_o[0], atol=2e-5, rtol=1e-4)
    close("conv", conv[2], want_conv[0], atol=0)
    close("ssm", ssm[2], want_ssm[0], atol=2e-5, rtol=1e-4)
    others = [0, 1, 3, 4]
    assert torch.equal(conv[others], conv0[others]) and torch.equal(ssm[others], ssm0[others])


def test_prefill_chunk_size_does_not_matter(so: Backend) -> None:
    conv, ssm, cw = states(22)
    qkv, g, beta = seq(90, 23)
    outs = []
    for chunk in (1, 8, 64, 200):
        c, s = conv.clone(), ssm.clone()
        o = so.deltanet.prefill(qkv, g, beta, c, s, 0, cw, chunk=chunk, **HEADS)  # type: ignore[arg-type]
        outs.append((chunk, o, s[0]))
    for chunk, o, s in outs[1:]:
        close(f"o chunk {chunk}", o, outs[0][1], atol=5e-5, rtol=1e-4)
        close(f"ssm chunk {chunk}", s, outs[0][2], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 2, 40, 99])
def test_prefill_split_carries_state(so: Backend, split: int) -> None:
    conv, ssm, cw = states(24)
    qkv, g, beta = seq(100, 25)
    c1, s1 = conv.clone(), ssm.clone()
    o_all = so.deltanet.prefill(qkv, g, beta, c1, s1, 4, cw, chunk=16, **HEADS)  # type: ignore[arg-type]
    c2, s2 = conv.clone(), ssm.clone()
    a, b = slice(0, split), slice(split, None)
    o_a = so.deltanet.prefill(qkv[a], g[a], beta[a], c2, s2, 4, cw, chunk=16, **HEADS)  # type: ignore[arg-type]
    o_b = so.deltanet.prefill(qkv[b], g[b], beta[b], c2, s2, 4, cw, chunk=16, **HEADS)  # type: ignore[arg-type]
    close("o", torch.cat((o_a, o_b)), o_all, atol=5e-5, rtol=1e-4)
    close("conv", c2[4], c1[4], atol=0)
    close("ssm", s2[4], s1[4], atol=5e-5, rtol=1e-4)


def test_decode_after_prefill_equals_longer_prefill(so: Backend) -> None:
    conv, ssm, cw = states(26)
    qkv, g, beta = seq(45, 27)
    c1, s1 = conv.clone(), ssm.clone()
    o_all = so.deltanet.prefill(qkv, g, beta, c1, s1, 1, cw, **HEADS)  # type: ignore[arg-type]
    c2, s2 = conv.clone(), ssm.clone()
    outs = [so.deltanet.prefill(qkv[:40], g[:40], beta[:40], c2, s2, 1, cw, **HEADS)]  # type: ignore[arg-type]
    slot = torch.tensor([1], dtype=torch.int32)
    for i in range(40, 45):
        y = so.deltanet.conv_step(qkv[i : i + 1], c2, slot, cw)
        outs.append(so.deltanet.step(y, g[i : i + 1], beta[i : i + 1], s2, slot, **HEADS))  # type: ignore[arg-type]
    close("o", torch.cat(outs), o_all, atol=5e-5, rtol=1e-4)
    close("conv", c2[1], c1[1], atol=0)
    close("ssm", s2[1], s1[1], atol=5e-5, rtol=1e-4)


def test_chunked_device_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several batched blocks of chunks (a small element budget) == the reference chunked rule."""
    g = gen(28)
    t, h, d = 77, 3, 8
    q = deltanet.l2_norm(torch.randn(t, h, d, generator=g), 1e-6) * d**-0.5
    k = deltanet.l2_norm(torch.randn(t, h, d, generator=g), 1e-6)
    v = torch.randn(t, h, d, generator=g)
    lg = -F.softplus(torch.randn(t, h, generator=g)) * 4
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    state = torch.randn(h, d, d, generator=g)
    monkeypatch.setattr(deltanet_chunked, "_PREFILL_ELEMS", h * 8 * 8 * 3)  # 3 chunks per block
    o, s = delta_rule_chunked_device(q, k, v, lg, beta, state, chunk=8)
    want_o, want_s = deltanet.delta_rule_chunked(
        q[None], k[None], v[None], lg[None], beta[None], state[None], chunk=8
    )
    close("o", o, want_o[0], atol=2e-5, rtol=1e-4)
    close("state", s, want_s[0], atol=2e-5, rtol=1e-4)


def test_deltanet_bad_shapes(so: Backend) -> None:
    conv, ssm, cw = states(29)
    slots = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="conv"):
        so.deltanet.conv_step(torch.zeros(1, C), conv[:, :2], slots, cw)
    with pytest.raises(ValueError, match="slots"):
        so.deltanet.conv_step(torch.zeros(2, C), conv, slots, cw)
    with pytest.raises(ValueError, match="y"):
        so.deltanet.step(
            torch.zeros(1, C + 1), torch.zeros(1, HV), torch.zeros(1, HV), ssm, slots, **HEADS
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple"):
        so.deltanet.step(torch.zeros(1, C), torch.zeros(1, HV), torch.zeros(1, HV), ssm, slots,
                      n_k_heads=4, n_v_heads=HV, head_dim=D, eps=EPS)  # fmt: skip
    with pytest.raises(ValueError, match="slot 5"):
        so.deltanet.prefill(torch.zeros(3, C), torch.zeros(3, HV), torch.zeros(3, HV), conv, ssm,
                         5, cw, **HEADS)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ValueError, match="z"):
        so.norm.gated(torch.zeros(2, HV, D), torch.zeros(2, HV * D + 1), torch.zeros(D), EPS, True)
