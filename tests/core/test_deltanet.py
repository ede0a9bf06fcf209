"""The Gated DeltaNet ops: chunked == recurrent for any chunk size and any split of the sequence,
the causal conv carries its state, and both match Hugging Face's torch reference kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference.deltanet import (
    causal_conv,
    delta_rule,
    delta_rule_chunked,
    delta_rule_recurrent,
    l2_norm,
)
from tests.hf_version import pinned_transformers

B, T, H, DK, DV = 2, 50, 3, 16, 8


pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(seed: int = 0, strong_decay: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = l2_norm(randn(B, T, H, DK), 1e-6) * DK**-0.5
    k = l2_norm(randn(B, T, H, DK), 1e-6)
    scale = 8.0 if strong_decay else 1.0  # strong: exp(g) down to ~e^-20 per token
    g = -F.softplus(randn(B, T, H)) * scale  # [B, T, H] log decay, <= 0
    return {
        "q": q,
        "k": k,
        "v": randn(B, T, H, DV),
        "g": g,
        "beta": torch.sigmoid(randn(B, T, H)),
        "state": randn(B, H, DK, DV) * 0.5,  # a non-zero entering state
    }


@pytest.mark.parametrize("chunk", [1, 2, 7, 16, 64, T])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_equals_recurrent(chunk: int, strong_decay: bool) -> None:
    x = inputs(strong_decay=strong_decay)
    o_ref, s_ref = delta_rule_recurrent(**x)
    o, s = delta_rule_chunked(**x, chunk=chunk)
    assert o.shape == (B, T, H, DV) and s.shape == (B, H, DK, DV)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("split", [1, 13, 49])
def test_split_sequence_carries_state(split: int) -> None:
    x = inputs(seed=1)
    o_all, s_all = delta_rule(**x, chunk=8)
    first = {k: v[:, :split] for k, v in x.items() if k != "state"}
    second = {k: v[:, split:] for k, v in x.items() if k != "state"}
    o1, s1 = delta_rule(**first, state=x["state"], chunk=8)
    o2, s2 = delta_rule(**second, state=s1, chunk=8)
    torch.testing.assert_close(torch.cat((o1, o2), dim=1), o_all, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-5)


def test_state_matters() -> None:
    """Guards the tests above against a state that is silently ignored."""
    x = inputs(seed=2)
    o1, _ = delta_rule_chunked(**x, chunk=16)
    o2, _ = delta_rule_chunked(**{**x, "state": torch.zeros_like(x["state"])}, chunk=16)
    assert (o1 - o2).abs().max() > 1e-2


def test_matches_transformers_kernels() -> None:
    """HF's torch_chunk / torch_recurrent_gated_delta_rule take un-normalised q, k and H_k < H_v
    key heads (each serving consecutive value heads); we expand heads and normalise first."""
    pinned_transformers()
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(3)
    hk, hv = 2, 4
    q, k = torch.randn(1, T, hk, DK, generator=gen), torch.randn(1, T, hk, DK, generator=gen)
    v = torch.randn(1, T, hv, DV, generator=gen)
    g = -F.softplus(torch.randn(1, T, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(1, T, hv, generator=gen))
    state = torch.randn(1, hv, DK, DV, generator=gen)
    want_o, want_s = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    qn = l2_norm(q, 1e-6).repeat_interleave(hv // hk, dim=2) * DK**-0.5
    kn = l2_norm(k, 1e-6).repeat_interleave(hv // hk, dim=2)
    for chunk in (64, 5):
        o, s = delta_rule_chunked(qn, kn, v, g, beta, state, chunk=chunk)
        torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, want_s, rtol=1e-4, atol=1e-5)
    want_o1, want_s1 = hf.torch_recurrent_gated_delta_rule(
        q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    o1, s1 = delta_rule_recurrent(qn[:, :1], kn[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)
    torch.testing.assert_close(o1, want_o1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, want_s1, rtol=1e-5, atol=1e-6)


def test_causal_conv_carries_state() -> None:
    gen = torch.Generator().manual_seed(4)
    c, kern = 6, 4
    x = torch.randn(2, 20, c, generator=gen)
    w = torch.randn(c, kern, generator=gen)
    zero = torch.zeros(2, kern - 1, c)
    y, state = causal_conv(x, zero, w)
    # the same depthwise conv as torch's, left-padded with zeros
    want = F.conv1d(x.transpose(1, 2), w[:, None, :], padding=kern - 1, groups=c)[..., :20]
    torch.testing.assert_close(y, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, x[:, -(kern - 1) :])
    y1, s1 = causal_conv(x[:, :7], zero, w)
    y2, s2 = causal_conv(x[:, 7:8], s1, w)
    y3, s3 = causal_conv(x[:, 8:], s2, w)
    torch.testing.assert_close(torch.cat((y1, y2, y3), dim=1), y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s3, state)


def test_bad_chunk() -> None:
    with pytest.raises(ValueError, match="chunk"):
        delta_rule_chunked(**inputs(), chunk=0)
