"""Gated DeltaNet (qwen3next linear attention) on the reference path.

Per value head h the state S is a [d_k, d_v] matrix; each token t, with decay a_t = exp(g_t) and
write strength beta_t, does (Hugging Face ``torch_recurrent_gated_delta_rule``, llama.cpp
``build_delta_net_*``)::

    S <- a_t S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T     # the delta rule: write only what S mispredicts
    o_t = S^T q_t

``delta_rule_recurrent`` runs that loop (decode). ``delta_rule_chunked`` computes the same over
chunks of C tokens with matrix products (prompts): inside a chunk, with G the cumulative log decay,
the C sequential rank-1 updates collapse into a unit lower-triangular solve (the WY / UT form of
FLA and HF ``torch_chunk_gated_delta_rule``). Both take and return the state, so any split of a
prompt into chunks, and any chunk size, gives the same outputs and final state up to rounding.

Layout as llama.cpp's qwen3next stores it: ``attn_qkv`` rows are [q (all key heads) | k | v (all
value heads)], ``ssm_ba`` rows are grouped per key head as [beta (r) | alpha (r)] with r = value
heads per key head, and value head j reads key head j // r (grouped, not tiled; only Qwen3.5 files
reorder value heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.reference import ops, rowwise


@dataclass
class DeltaNetWeights:  # [out, in] float32
    qkv: torch.Tensor  # [conv_dim, n_embd] (attn_qkv): [q | k | v]
    z: torch.Tensor  # [value_dim, n_embd] (attn_gate): the output gate before silu
    ba: torch.Tensor  # [2 * H_v, n_embd] (ssm_ba), grouped per key head as [beta | alpha]
    conv: torch.Tensor  # [conv_dim, kernel] (ssm_conv1d), depthwise
    dt_bias: torch.Tensor  # [H_v] (ssm_dt.bias)
    a: torch.Tensor  # [H_v] (ssm_a) = -exp(A_log), negative
    norm: torch.Tensor  # [d_v] (ssm_norm), plain (not 1 + w)
    out: torch.Tensor  # [n_embd, value_dim] (ssm_out)
    sigmoid_gate: bool = False  # output gate sigmoid(z) (qwen4exp) instead of silu(z)


def causal_conv(
    x: torch.Tensor,  # [B, T, C] new inputs
    state: torch.Tensor,  # [B, K - 1, C] the previous K - 1 inputs (zeros at the start)
    weight: torch.Tensor,  # [C, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # y [B, T, C] (before silu), new state [B, K - 1, C]
    """Depthwise causal conv: y_t = sum_j w[:, j] * x_{t - K + 1 + j}, earlier inputs from state."""
    k = weight.shape[1]
    xp = torch.cat((state, x), dim=1)  # [B, K - 1 + T, C]
    windows = xp.unfold(1, k, 1)  # [B, T, C, K]
    y = (windows * weight).sum(-1)
    return y, xp[:, xp.shape[1] - (k - 1) :].clone()


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's form, which llama.cpp reproduces)."""
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def delta_rule_recurrent(
    q: torch.Tensor,  # [B, T, H, d_k] already L2-normed and scaled
    k: torch.Tensor,  # [B, T, H, d_k] L2-normed
    v: torch.Tensor,  # [B, T, H, d_v]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H] in (0, 1)
    state: torch.Tensor,  # [B, H, d_k, d_v]
) -> tuple[torch.Tensor, torch.Tensor]:  # o [B, T, H, d_v], new state
    """The delta rule one token at a time. Elementwise products and sums only (and a row-wise
    exp), so a session's result does not depend on how many others share the batch."""
    outs = []
    for t in range(q.shape[1]):
        state = state * rowwise.exp(g[:, t])[..., None, None]
        predicted = (state * k[:, t, :, :, None]).sum(dim=2)  # [B, H, d_v] = S^T k
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(dim=2))  # [B, H, d_v] = S^T q
    return torch.stack(outs, dim=1), state


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as ``delta_rule_recurrent`` (same shapes), ``chunk`` tokens per matrix step.

    Uses batched matmuls, whose rounding may depend on B: callers that need batch-invariant
    results (the model) run it one session at a time."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    outs = []
    for c0 in range(0, q.shape[2], chunk):
        qc, kc, vc = (x[:, :, c0 : c0 + chunk] for x in (q, k, v))  # [B, H, C, d]
        bc = beta[:, :, c0 : c0 + chunk]  # [B, H, C]
        cum = g[:, :, c0 : c0 + chunk].cumsum(-1)  # [B, H, C]: log decay from chunk start to i
        n = cum.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()  # [C, C] j <= i
        # decay[i, j] = exp(G_i - G_j) for j <= i; masked before exp so nothing overflows
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -torch.inf).exp()
        # Row i of the UT system: beta_i k_i . k_j decay[i, j] for j < i, ones on the diagonal.
        system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)  # [B, H, C, C]
        system = system + torch.eye(n)
        u = torch.linalg.solve_triangular(
            system, bc[..., None] * vc, upper=False, unitriangular=True
        )  # [B, H, C, d_v] new values if the state were zero
        w = torch.linalg.solve_triangular(
            system, bc[..., None] * kc * cum.exp()[..., None], upper=False, unitriangular=True
        )  # [B, H, C, d_k] how much of the entering state each token's write cancels
        v_new = u - w @ state  # [B, H, C, d_v]
        inter = (qc * cum.exp()[..., None]) @ state  # [B, H, C, d_v] read of the entering state
        intra = ((qc @ kc.transpose(-1, -2)) * decay) @ v_new  # [B, H, C, d_v]
        outs.append(inter + intra)
        last = cum[..., -1:]  # [B, H, 1]
        state = (
            state * last.exp()[..., None]
            + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    return torch.cat(outs, dim=2).transpose(1, 2), state


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent for a single token (decode), chunked otherwise.

    The arguments are ``delta_rule_chunked``'s, repeated on purpose: both forms stay callable on
    their own (tests and the device path compare against each), and this one only dispatches."""
    if q.shape[1] == 1:
        return delta_rule_recurrent(q, k, v, g, beta, state)
    return delta_rule_chunked(q, k, v, g, beta, state, chunk)


def project(
    x: torch.Tensor, w: DeltaNetWeights, hp: HybridSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-wise input projections of x [N, n_embd]: qkv [N, conv_dim], z [N, H_v, d_v],
    decay g [N, H_v] and write strength beta [N, H_v]."""
    n, r = x.shape[0], hp.ssm_v_heads // hp.ssm_k_heads
    ba = ops.linear(x, w.ba).view(n, hp.ssm_k_heads, 2 * r)  # [N, H_k, 2r]
    beta = rowwise.sigmoid(ba[..., :r].reshape(n, hp.ssm_v_heads))
    alpha = ba[..., r:].reshape(n, hp.ssm_v_heads)
    g = rowwise.softplus(alpha + w.dt_bias) * w.a  # [N, H_v] log decay: -exp(A_log) softplus()
    z = ops.linear(x, w.z).view(n, hp.ssm_v_heads, hp.ssm_head_dim)
    return ops.linear(x, w.qkv), z, g, beta


def mix(
    qkv: torch.Tensor,  # [B, T, conv_dim] B sessions of T tokens each
    g: torch.Tensor,  # [B, T, H_v]
    beta: torch.Tensor,  # [B, T, H_v]
    conv_state: torch.Tensor,  # [B, K - 1, conv_dim]
    ssm_state: torch.Tensor,  # [B, H_v, d_k, d_v]
    w: DeltaNetWeights,
    hp: HybridSpec,
    eps: float,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # o [B, T, H_v, d_v], conv, ssm states
    """The sequential part of a DeltaNet layer: conv, L2 norms, head expansion, delta rule.

    ``eps`` of the L2 norms is the model's RMS eps, as llama.cpp has it (HF fixes 1e-6; the
    released models use 1e-6 for both)."""
    b, t = qkv.shape[:2]
    d, r = hp.ssm_head_dim, hp.ssm_v_heads // hp.ssm_k_heads
    y, conv_state = causal_conv(qkv, conv_state, w.conv)
    y = rowwise.silu(y)
    q = y[..., : hp.key_dim].reshape(b, t, hp.ssm_k_heads, d)
    k = y[..., hp.key_dim : 2 * hp.key_dim].reshape(b, t, hp.ssm_k_heads, d)
    v = y[..., 2 * hp.key_dim :].reshape(b, t, hp.ssm_v_heads, d)
    q = l2_norm(q, eps).repeat_interleave(r, dim=2) * d**-0.5  # [B, T, H_v, d_k]
    k = l2_norm(k, eps).repeat_interleave(r, dim=2)
    o, ssm_state = delta_rule(q, k, v, g, beta, ssm_state, chunk)
    return o, conv_state, ssm_state


def output(o: torch.Tensor, z: torch.Tensor, w: DeltaNetWeights, eps: float) -> torch.Tensor:
    """RMSNorm(o) * silu(z) (sigmoid(z) for qwen4exp) per value head, then the out projection:
    [N, H_v, d_v] -> [N, d]."""
    act = rowwise.sigmoid if w.sigmoid_gate else rowwise.silu
    h = ops.rms_norm(o, w.norm, eps) * act(z.flatten(1)).view(z.shape)
    return ops.linear(h.flatten(1), w.out)
