"""The deltanet family: the Gated DeltaNet steps of qwen3next / qwen4exp (causal conv, the gated
delta rule) for decode (B sessions, one token each) and prefill (one session's chunk).

State lives in per-layer pools indexed by slot: ``conv`` [n_slots, K - 1, C] and ``ssm``
[n_slots, H_v, d_k, d_v]; the decode ops take ``slots`` [B] int32 and update only those slots, in
place, static-shape and sync-free (CUDA-graph capturable); ``prefill`` may synchronise. Slots are
distinct, but for ``chains`` (ops/chains.py): the rows of a run share their slot and go through
the recurrence in order, each with the single-row arithmetic.
Channel layout of the conv input / output (llama.cpp's ``attn_qkv``): [q (all key heads) | k (all
key heads) | v (all value heads)], C = (2 H_k + H_v) d; value head j reads key head
j // (H_v / H_k).

``DeltaNetTorch`` is ``mgserve.core.reference.deltanet`` op for op, but for the chunked delta rule
of prefill, which is reorganised into few large ops (deltanet_chunked.py); ``DeltaNetCuda``
(deltanet_cuda.py) runs the decode steps on kernels.
"""

from __future__ import annotations

import torch

from mgserve.core.reference import deltanet, rowwise
from mgserve.cuda.checks import check_f32, check_index, shape_error
from mgserve.cuda.ops.chains import Chains, histories
from mgserve.cuda.ops.deltanet_chunked import delta_rule_chunked_device


def deltanet_dims(n_k_heads: int, n_v_heads: int, head_dim: int) -> int:
    """C, the conv channel count; ValueError on impossible head counts."""
    if min(n_k_heads, n_v_heads, head_dim) < 1 or n_v_heads % n_k_heads:
        raise ValueError(
            f"DeltaNet heads: n_v_heads {n_v_heads} must be a positive multiple of n_k_heads "
            f"{n_k_heads}, head_dim {head_dim} positive"
        )
    return (2 * n_k_heads + n_v_heads) * head_dim


def check_conv(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor) -> int:
    """x [B or T, C], conv [n_slots, K - 1, C], weight [C, K]; returns K."""
    for name, t in (("x", x), ("conv", conv), ("weight", weight)):
        check_f32(name, t)
    if x.dim() != 2:
        raise shape_error("x", x, "[B, C]")
    c = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        raise shape_error("weight", weight, f"[{c}, K]")
    k = weight.shape[1]
    if conv.dim() != 3 or conv.shape[1:] != (k - 1, c):
        raise shape_error("conv", conv, f"[n_slots, {k - 1}, {c}]")
    return k


def check_ssm(ssm: torch.Tensor, n_v_heads: int, head_dim: int) -> None:
    check_f32("ssm", ssm)
    if ssm.dim() != 4 or ssm.shape[1:] != (n_v_heads, head_dim, head_dim):
        raise shape_error("ssm", ssm, f"[n_slots, {n_v_heads}, {head_dim}, {head_dim}]")


def check_gb(g: torch.Tensor, beta: torch.Tensor, n: int, n_v_heads: int) -> None:
    for name, t in (("g", g), ("beta", beta)):
        check_f32(name, t)
        if t.shape != (n, n_v_heads):
            raise shape_error(name, t, f"[{n}, {n_v_heads}]")


def split_qkv(
    y: torch.Tensor, n_k_heads: int, n_v_heads: int, head_dim: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output y [..., C] -> q, k [..., H_v, d] (L2-normed, q scaled, key heads repeated for
    their value heads) and v [..., H_v, d], exactly as ``deltanet.mix``."""
    d, kd, r = head_dim, n_k_heads * head_dim, n_v_heads // n_k_heads
    lead = y.shape[:-1]
    q = y[..., :kd].reshape(*lead, n_k_heads, d)
    k = y[..., kd : 2 * kd].reshape(*lead, n_k_heads, d)
    v = y[..., 2 * kd :].reshape(*lead, n_v_heads, d)
    q = deltanet.l2_norm(q, eps).repeat_interleave(r, dim=-2) * d**-0.5
    k = deltanet.l2_norm(k, eps).repeat_interleave(r, dim=-2)
    return q, k, v


def check_gates(
    b: torch.Tensor, alpha: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor
) -> tuple[int, int]:
    """b and alpha [N, H_v] (rows may be strided, values not), dt_bias and a [H_v]: (N, H_v)."""
    for name, t in (("b", b), ("alpha", alpha), ("dt_bias", dt_bias), ("a", a)):
        check_f32(name, t)
    if b.dim() != 2:
        raise shape_error("b", b, "[N, H_v]")
    n, hv = b.shape
    for name, t in (("alpha", alpha), ("b", b)):
        if t.shape != (n, hv) or (n and t.stride(1) != 1):
            raise shape_error(name, t, f"[{n}, {hv}] with unit column stride")
    for name, t in (("dt_bias", dt_bias), ("a", a)):
        if t.shape != (hv,):
            raise shape_error(name, t, f"[{hv}]")
    return n, hv


def check_step(
    y: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
    n_k_heads: int,
    n_v_heads: int,
    head_dim: int,
) -> int:
    """The shapes of a decode step's inputs (both twins); the number of sessions B."""
    b = check_step_state(y, ssm, slots, n_k_heads, n_v_heads, head_dim)
    check_gb(g, beta, b, n_v_heads)
    return b


def check_step_state(
    y: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, n_k_heads: int, n_v_heads: int,
    head_dim: int,
) -> int:  # fmt: skip
    """``check_step`` without the gates."""
    c = deltanet_dims(n_k_heads, n_v_heads, head_dim)
    if y.dim() != 2 or y.shape[1] != c:
        raise shape_error("y", y, f"[B, {c}]")
    check_ssm(ssm, n_v_heads, head_dim)
    check_index("slots", slots, y.shape[0])
    return y.shape[0]


def check_prefill(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    slot: int,
    weight: torch.Tensor,
    n_k_heads: int,
    n_v_heads: int,
    head_dim: int,
) -> int:
    """The shapes of a prefill's inputs (both twins) and its slot; the number of tokens T."""
    c = deltanet_dims(n_k_heads, n_v_heads, head_dim)
    check_conv(qkv, conv, weight)
    if qkv.shape[1] != c or qkv.shape[0] < 1:
        raise shape_error("qkv", qkv, f"[T >= 1, {c}]")
    t = qkv.shape[0]
    check_gb(g, beta, t, n_v_heads)
    check_ssm(ssm, n_v_heads, head_dim)
    if not 0 <= slot < conv.shape[0] or conv.shape[0] != ssm.shape[0]:
        raise ValueError(
            f"slot {slot} out of range (conv has {conv.shape[0]} slots, ssm {ssm.shape[0]})"
        )
    return t


class DeltaNetTorch:
    """The DeltaNet steps in PyTorch on the tensors' device (the reference arithmetic)."""

    def gates(
        self,
        b: torch.Tensor,  # [N, H_v] the beta projection
        alpha: torch.Tensor,  # [N, H_v] the alpha projection
        dt_bias: torch.Tensor,  # [H_v]
        a: torch.Tensor,  # [H_v] -exp(A_log)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # g, beta [N, H_v] contiguous
        """Log decay g = softplus(alpha + dt_bias) * a and write strength beta = sigmoid(b) of
        each token and value head (``deltanet.project``'s gates)."""
        check_gates(b, alpha, dt_bias, a)
        g = rowwise.softplus(alpha + dt_bias) * a
        return g.contiguous(), rowwise.sigmoid(b).contiguous()

    def conv_step(
        self,
        x: torch.Tensor,  # [B, C] this token's raw qkv of each session
        conv: torch.Tensor,  # [n_slots, K - 1, C] previous inputs, oldest first (updated)
        slots: torch.Tensor,  # [B] int32, distinct (but for chains' runs)
        weight: torch.Tensor,  # [C, K] depthwise conv weight
        chains: Chains | None = None,
    ) -> torch.Tensor:  # [B, C] silu(causal conv)
        """One decode token of the depthwise causal conv + silu; shifts conv[slots[b]] (drops the
        oldest input, appends x[b]); a run's rows one after the other. Sync-free."""
        check_conv(x, conv, weight)
        check_index("slots", slots, x.shape[0])
        idx = slots.long()
        if chains is None or chains.alone:
            y, new = deltanet.causal_conv(x[:, None], conv.index_select(0, idx), weight)
            conv.index_copy_(0, idx, new)
        else:  # each row's own history: the slot's, then its run's rows before it
            y, new = deltanet.causal_conv(x[:, None], histories(conv, x, slots, chains), weight)
            conv.index_copy_(0, idx, chains.select(new))  # a run's rows write the same state
        return rowwise.silu(y[:, 0]).contiguous()

    def step(
        self,
        y: torch.Tensor,  # [B, C] conv_step's output
        g: torch.Tensor,  # [B, H_v] log decay
        beta: torch.Tensor,  # [B, H_v] write strength
        ssm: torch.Tensor,  # [n_slots, H_v, d_k, d_v] (updated)
        slots: torch.Tensor,  # [B] int32, distinct (but for chains' runs)
        *,
        n_k_heads: int,
        n_v_heads: int,
        head_dim: int,
        eps: float,
        chains: Chains | None = None,
    ) -> torch.Tensor:  # o [B, H_v, d_v]
        """One decode token of the gated delta rule for B sessions: q, k L2-normed per key head
        (q scaled by head_dim^-0.5), then S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q
        on ssm[slots[b]] in place. Sync-free. With ``chains``: ``chains.longest`` waves over
        all rows, wave j advancing the rows j of the runs from their predecessor's state."""
        check_f32("y", y)
        check_step(y, g, beta, ssm, slots, n_k_heads, n_v_heads, head_dim)
        idx = slots.long()
        q, k, v = split_qkv(y[:, None], n_k_heads, n_v_heads, head_dim, eps)  # [B, 1, H_v, d]
        state = ssm.index_select(0, idx)
        if chains is None or chains.alone:
            o, new = deltanet.delta_rule_recurrent(q, k, v, g[:, None], beta[:, None], state)
            ssm.index_copy_(0, idx, new)
            return o[:, 0]
        depth = chains.depth.long()[:, None, None, None]  # [B, 1, 1, 1]
        out, after = torch.zeros_like(v), state  # [B, 1, H_v, d]; each row's state after it
        for j in range(chains.longest):
            o, new = deltanet.delta_rule_recurrent(q, k, v, g[:, None], beta[:, None], state)
            out = torch.where(depth == j, o, out)
            after = torch.where(depth == j, new, after)
            before_next = torch.cat((new[:1], new[:-1]))  # row i - 1's new state, at row i
            state = torch.where(depth == j + 1, before_next, state)
        ssm.index_copy_(0, idx, chains.select(after))  # a run's rows write the same state
        return out[:, 0]

    def step_gates(
        self, y: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, dt_bias: torch.Tensor,
        a: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, *, n_k_heads: int,
        n_v_heads: int, head_dim: int, eps: float, chains: Chains | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``step`` with g, beta = ``gates(b, alpha, dt_bias, a)`` (the CUDA version makes them
        inside the step's kernel)."""
        g, beta = self.gates(b, alpha, dt_bias, a)
        return self.step(
            y, g, beta, ssm, slots, n_k_heads=n_k_heads, n_v_heads=n_v_heads, head_dim=head_dim,
            eps=eps, chains=chains,
        )  # fmt: skip

    def prefill(
        self,
        qkv: torch.Tensor,  # [T, C] raw (pre-conv) projections of one session's tokens
        g: torch.Tensor,  # [T, H_v]
        beta: torch.Tensor,  # [T, H_v]
        conv: torch.Tensor,  # [n_slots, K - 1, C] (conv[slot] updated)
        ssm: torch.Tensor,  # [n_slots, H_v, d_k, d_v] (ssm[slot] updated)
        slot: int,
        weight: torch.Tensor,  # [C, K]
        *,
        n_k_heads: int,
        n_v_heads: int,
        head_dim: int,
        eps: float,
        chunk: int = 64,
    ) -> torch.Tensor:  # o [T, H_v, d_v]
        """``deltanet.mix`` for one session (B = 1) of T >= 1 tokens, on the tensors' device:
        conv + silu, L2 norms, then the chunked delta rule (the recurrent one for T = 1, as the
        reference does). Continues from and updates the slot's conv and ssm states, so a prompt
        split across calls gives the result of one call. May synchronise (prefill only)."""
        t = check_prefill(qkv, g, beta, conv, ssm, slot, weight, n_k_heads, n_v_heads, head_dim)
        y, new_conv = deltanet.causal_conv(qkv[None], conv[slot : slot + 1], weight)
        y = rowwise.silu(y[0])  # [T, C]
        q, k, v = split_qkv(y, n_k_heads, n_v_heads, head_dim, eps)  # [T, H_v, d]
        if t == 1:
            o, state = deltanet.delta_rule_recurrent(
                q[None], k[None], v[None], g[None], beta[None], ssm[slot : slot + 1]
            )
            o, state = o[0], state[0]
        else:
            o, state = delta_rule_chunked_device(q, k, v, g, beta, ssm[slot], chunk)
        conv[slot] = new_conv[0]
        ssm[slot] = state
        return o
