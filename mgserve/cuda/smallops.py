"""The small-ops family of the device backend: RMSNorm, RoPE (and the two fused, for per-head q/k
norms), the gated MLP activations, and the Gated DeltaNet steps (causal conv, delta rule, gated
output norm) of qwen3next / qwen4exp.

``SmallOpsTorch`` computes each op with the reference path's own functions (or the same arithmetic
made device-agnostic), so on the CPU it equals ``mgserve.core.reference`` op for op;
``SmallOpsCuda`` runs the kernels of ``kernels/norm.cu``, ``kernels/act.cu`` and
``kernels/deltanet.cu``. Every decode-time op is static-shape and sync-free in both versions
(CUDA-graph capturable); ``delta_prefill`` (one session's prompt chunk) may synchronise.

DeltaNet state lives in per-layer pools indexed by slot: ``conv`` [n_slots, K - 1, C] and ``ssm``
[n_slots, H_v, d_k, d_v]; the decode ops take ``slots`` [B] int32 (distinct) and update only those
slots, in place. Channel layout of the conv input / output (llama.cpp's ``attn_qkv``): [q (all key
heads) | k (all key heads) | v (all value heads)], C = (2 H_k + H_v) d; value head j reads key
head j // (H_v / H_k).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import deltanet, ops, rowwise
from mgserve.cuda.kbase import CudaBase, TorchBase, check_cuda, check_f32, check_index, shape_error

NORM_SOURCE = "norm.cu"
ACT_SOURCE = "act.cu"
DELTANET_SOURCE = "deltanet.cu"
ROPE_WARPS = 4  # ROPE heads per CTA of rms_norm_rope_f32: one warp per head
ROPE_MAX_DIM = 2048  # head dim bound of rms_norm_rope_f32 (shared memory: ROPE_WARPS rows of D)
ACT_THREADS = 256  # threads per CTA of the activation kernels (one float4 or float each)
CONV_THREADS = 128  # channels per CTA of conv_step_f32
DELTA_COLS = 32  # DELTA_COLS in deltanet.cu: state columns (lanes) per CTA of delta_step_f32
DELTA_SPLIT = 4  # DELTA_SPLIT in deltanet.cu: warps per CTA, each owning 1/4 of the state rows
MAX_CONV_K = 8  # conv kernel widths the kernel is instantiated for: 1..MAX_CONV_K
_PREFILL_ELEMS = 1 << 25  # bound on H * chunks * chunk^2 of one batched block of delta_prefill
_GATE_NONE, _GATE_SILU, _GATE_SIGMOID = 0, 1, 2  # gate modes of rms_norm_f32


def _check_norm(x: torch.Tensor, w: torch.Tensor) -> None:
    """x [..., D] with w [D], or x [..., G, D] with w [G, D]."""
    check_f32("x", x)
    check_f32("w", w)
    if w.dim() == 1:
        ok = x.dim() >= 1 and x.shape[-1] == w.shape[0]
    else:
        ok = w.dim() == 2 and x.dim() >= 2 and tuple(x.shape[-2:]) == tuple(w.shape)
    if not ok:
        raise ValueError(
            f"rms_norm: weight {list(w.shape)} does not match x {list(x.shape)} "
            "(expected w [D] with x [..., D], or w [G, D] with x [..., G, D])"
        )


def _check_rope(x: torch.Tensor, pos: torch.Tensor, n_rot: int, ff: torch.Tensor | None) -> None:
    check_f32("x", x)
    if x.dim() != 3:
        raise shape_error("x", x, "[N, H, D]")
    check_index("pos", pos, x.shape[0])
    if n_rot < 2 or n_rot % 2 or n_rot > x.shape[2]:
        raise ValueError(f"n_rot must be even and in 2..{x.shape[2]} (head dim), got {n_rot}")
    if ff is not None and (ff.dim() != 1 or ff.shape[0] != n_rot // 2):
        raise shape_error("freq_factors", ff, f"[{n_rot // 2}]")


def _check_gate_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_f32("gate", gate)
    check_f32("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ in shape")


def _deltanet_dims(n_k_heads: int, n_v_heads: int, head_dim: int) -> int:
    """C, the conv channel count; ValueError on impossible head counts."""
    if min(n_k_heads, n_v_heads, head_dim) < 1 or n_v_heads % n_k_heads:
        raise ValueError(
            f"DeltaNet heads: n_v_heads {n_v_heads} must be a positive multiple of n_k_heads "
            f"{n_k_heads}, head_dim {head_dim} positive"
        )
    return (2 * n_k_heads + n_v_heads) * head_dim


def _check_conv(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor) -> int:
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


def _check_ssm(ssm: torch.Tensor, n_v_heads: int, head_dim: int) -> None:
    check_f32("ssm", ssm)
    if ssm.dim() != 4 or ssm.shape[1:] != (n_v_heads, head_dim, head_dim):
        raise shape_error("ssm", ssm, f"[n_slots, {n_v_heads}, {head_dim}, {head_dim}]")


def _check_gb(g: torch.Tensor, beta: torch.Tensor, n: int, n_v_heads: int) -> None:
    for name, t in (("g", g), ("beta", beta)):
        check_f32(name, t)
        if t.shape != (n, n_v_heads):
            raise shape_error(name, t, f"[{n}, {n_v_heads}]")


def _split_qkv(
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


def _chunk_major(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """[T, H, ...] -> [n_chunks, H, chunk, ...] contiguous, zero-padded at the end."""
    pad = n_chunks * chunk - x.shape[0]
    if pad:
        x = torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))
    return x.view(n_chunks, chunk, *x.shape[1:]).transpose(1, 2).contiguous()


def delta_rule_chunked_device(
    q: torch.Tensor,  # [T, H, d_k] L2-normed and scaled
    k: torch.Tensor,  # [T, H, d_k] L2-normed
    v: torch.Tensor,  # [T, H, d_v]
    g: torch.Tensor,  # [T, H] log decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, d_k, d_v]
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, d_v], new state [H, d_k, d_v]
    """``deltanet.delta_rule_chunked`` for one session, on the tensors' device.

    Same chunk boundaries and algebra, reorganised so that a GPU runs few, large ops (prefill is
    bound by the host's launch rate otherwise). Everything that does not depend on the entering
    state is computed for a whole block of chunks at once (``_PREFILL_ELEMS`` bounds its size;
    a 4096-token prompt is one block): the decays, one batched unit-triangular solve for both
    right-hand sides, q k^T. Per chunk i, with Z_i = [V_i; S_i] ([C + d_k, d_v]: the chunk's
    corrected values over its entering state), only two products remain::

        V_i = U_i - W_i S_i                    (one in-place baddbmm)
        S_{i+1} = [K_i | keep_i I] Z_i         (one bmm: the state decay rides in the product)

    and the outputs of every chunk are one product afterwards: O_i = [A_i | Q_i] Z_i.
    Cumulative log decays are summed in float64, so exp(G_i - G_j) stays accurate for long
    chunks with strong decay (only differences <= 0 are exponentiated: nothing overflows).
    The last chunk is zero-padded (g = 0, beta = 0, k = q = v = 0), which changes nothing: padded
    rows write nothing and read nothing, and a zero log decay keeps the state."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    t, h, dk = k.shape
    dv = v.shape[-1]
    dev, dt = q.device, state.dtype
    n_chunks = -(-t // chunk)
    qb, kb, vb, gb, bb = (_chunk_major(x, n_chunks, chunk) for x in (q, k, v, g, beta))
    # qb, kb [n, H, C, d_k], vb [n, H, C, d_v], gb, bb [n, H, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril()  # [C, C] j <= i
    outs = torch.empty(n_chunks, h, chunk, dv, dtype=dt, device=dev)  # [n, H, C, d_v]
    group = max(1, _PREFILL_ELEMS // (h * chunk * chunk))  # chunks per batched block
    for c0 in range(0, n_chunks, group):
        sl = slice(c0, c0 + group)
        qc, kc, vc, bc = qb[sl], kb[sl], vb[sl], bb[sl]
        m = qc.shape[0]  # chunks in this block
        cum64 = gb[sl].double().cumsum(-1)  # [m, H, C] log decay from chunk start to i
        diff = (cum64[..., :, None] - cum64[..., None, :]).to(dt)  # [m, H, C, C]
        decay = diff.masked_fill_(~causal, -torch.inf).exp_()  # exp(G_i - G_j), 0 for j > i
        cum = cum64.to(dt)
        e_cum = cum.exp()[..., None]  # [m, H, C, 1]
        # Row i of the UT system: beta_i k_i . k_j decay[i, j] for j < i. The solve reads only
        # the strict lower triangle (ones assumed on the diagonal), so no tril / eye is needed.
        system = (kc @ kc.transpose(-1, -2)).mul_(decay).mul_(bc[..., None])  # [m, H, C, C]
        rhs = torch.cat((vc, kc * e_cum), dim=-1).mul_(bc[..., None])  # [m, H, C, d_v + d_k]
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = sol[..., :dv], sol[..., dv:]  # [m, H, C, d_v] values, [m, H, C, d_k] state cancel
        aq = torch.cat(((qc @ kc.transpose(-1, -2)).mul_(decay), qc * e_cum), dim=-1)
        # aq [m, H, C, C + d_k]: [intra-chunk attention | reads of the entering state]
        to_end = (cum64[..., -1:] - cum64).to(dt).exp_()  # [m, H, C] exp(G_last - G_i)
        kp = torch.zeros(m, h, dk, chunk + dk, dtype=dt, device=dev)  # [m, H, d_k, C + d_k]
        kp[..., :chunk] = (kc * to_end[..., None]).transpose(-1, -2)
        kp[..., chunk:].diagonal(dim1=-2, dim2=-1).copy_(cum[..., -1:].exp().expand(m, h, dk))
        z = torch.empty(m + 1, h, chunk + dk, dv, dtype=dt, device=dev)  # [m + 1, H, C + d_k, d_v]
        z[:m, :, :chunk] = u
        z[0, :, chunk:] = state
        # per-chunk views made up front (one unbind each, not a few views per chunk)
        zs, vs, ss = z.unbind(0), z[:, :, :chunk].unbind(0), z[:, :, chunk:].unbind(0)
        for wi, kpi, i in zip(w.unbind(0), kp.unbind(0), range(m), strict=True):
            vs[i].baddbmm_(wi, ss[i], alpha=-1)  # V_i = U_i - W_i S_i
            torch.bmm(kpi, zs[i], out=ss[i + 1])  # S_{i+1}
        torch.bmm(
            aq.view(m * h, chunk, chunk + dk),
            z[:m].view(m * h, chunk + dk, dv),
            out=outs[sl].view(m * h, chunk, dv),
        )
        state = z[m, :, chunk:]
    o = outs.transpose(1, 2).reshape(n_chunks * chunk, h, dv)[:t]  # [T, H, d_v]
    return o, state.contiguous()


class SmallOpsTorch(TorchBase):
    """The small ops in PyTorch on the tensors' device (the reference arithmetic)."""

    def __init__(self) -> None:
        super().__init__()
        self._inv_freq: dict[tuple[int, float, torch.device], torch.Tensor] = {}

    # -- norms, rope, activations ---------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * w over the last dim; x [..., D] f32, w [D] or [G, D] (then
        x is [..., G, D] and row g of every group uses w[g]: hyper-connection streams)."""
        _check_norm(x, w)
        return ops.rms_norm(x, w, eps)

    def inv_freq(self, n_rot: int, base: float, device: torch.device) -> torch.Tensor:
        """float64 [n_rot / 2] rotary frequencies base^(-2i / n_rot), computed on the CPU exactly as
        the reference does and cached per device (the first call copies: make it before a graph
        capture)."""
        key = (n_rot, float(base), device)
        t = self._inv_freq.get(key)
        if t is None:
            half = n_rot // 2
            cpu = float(base) ** (-torch.arange(half, dtype=torch.float64) * 2.0 / n_rot)
            t = self._inv_freq[key] = cpu.to(device)
        return t

    def rope(
        self,
        x: torch.Tensor,  # [N, H, D] f32
        pos: torch.Tensor,  # [N] int32 (or int64) absolute positions
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,  # [n_rot / 2] divisors (llama 3), or None
    ) -> torch.Tensor:  # [N, H, D], a new tensor
        """Rotary embedding of the first ``n_rot`` dims of each head (``ops.rope``): angles
        (pos * scale) * inv_freq in float64, cos/sin rounded to f32 once; neox pairs i with
        i + n_rot/2, otherwise 2i with 2i + 1. Dims >= n_rot pass through. Sync-free."""
        _check_rope(x, pos, n_rot, freq_factors)
        half = n_rot // 2
        inv = self.inv_freq(n_rot, base, x.device)
        if freq_factors is not None:
            inv = inv / freq_factors.to(torch.float64)
        theta = (pos.to(torch.float64) * float(scale))[:, None] * inv[None, :]  # [N, half]
        cos = theta.cos().float()[:, None, :]  # [N, 1, half]
        sin = theta.sin().float()[:, None, :]
        rot, rest = x[..., :n_rot], x[..., n_rot:]
        if neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1)

    def rms_norm_rope(
        self,
        x: torch.Tensor,  # [N, H, D] f32
        w: torch.Tensor,  # [D] per-head norm weight
        eps: float,
        pos: torch.Tensor,  # [N] int32
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [N, H, D]
        """rope(rms_norm(x, w, eps), pos, ...): the per-head q / k norm then rotary embedding of
        the attention layers, in one op."""
        if w.dim() != 1:
            raise shape_error("w", w, f"[{x.shape[-1]}] (one weight for every head)")
        h = self.rms_norm(x, w, eps)
        return self.rope(
            h, pos, n_rot=n_rot, base=base, neox=neox, scale=scale, freq_factors=freq_factors
        )

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (the SwiGLU MLP activation), same shape."""
        _check_gate_pair(gate, up)
        return ops.swiglu(gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (Gemma's GeGLU), same shape."""
        _check_gate_pair(gate, up)
        return ops.geglu(gate, up)

    # -- Gated DeltaNet ---------------------------------------------------------------------------

    def conv_step(
        self,
        x: torch.Tensor,  # [B, C] this token's raw qkv of each session
        conv: torch.Tensor,  # [n_slots, K - 1, C] previous inputs, oldest first (updated)
        slots: torch.Tensor,  # [B] int32, distinct
        weight: torch.Tensor,  # [C, K] depthwise conv weight
    ) -> torch.Tensor:  # [B, C] silu(causal conv)
        """One decode token of the depthwise causal conv + silu; shifts conv[slots[b]] (drops the
        oldest input, appends x[b]). Sync-free."""
        _check_conv(x, conv, weight)
        check_index("slots", slots, x.shape[0])
        idx = slots.long()
        y, new = deltanet.causal_conv(x[:, None], conv.index_select(0, idx), weight)
        conv.index_copy_(0, idx, new)
        return rowwise.silu(y[:, 0]).contiguous()

    def delta_step(
        self,
        y: torch.Tensor,  # [B, C] conv_step's output
        g: torch.Tensor,  # [B, H_v] log decay
        beta: torch.Tensor,  # [B, H_v] write strength
        ssm: torch.Tensor,  # [n_slots, H_v, d_k, d_v] (updated)
        slots: torch.Tensor,  # [B] int32, distinct
        *,
        n_k_heads: int,
        n_v_heads: int,
        head_dim: int,
        eps: float,
    ) -> torch.Tensor:  # o [B, H_v, d_v]
        """One decode token of the gated delta rule for B sessions: q, k L2-normed per key head
        (q scaled by head_dim^-0.5), then S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q
        on ssm[slots[b]] in place. Sync-free."""
        c = _deltanet_dims(n_k_heads, n_v_heads, head_dim)
        check_f32("y", y)
        if y.dim() != 2 or y.shape[1] != c:
            raise shape_error("y", y, f"[B, {c}]")
        b = y.shape[0]
        _check_gb(g, beta, b, n_v_heads)
        _check_ssm(ssm, n_v_heads, head_dim)
        check_index("slots", slots, b)
        idx = slots.long()
        q, k, v = _split_qkv(y[:, None], n_k_heads, n_v_heads, head_dim, eps)  # [B, 1, H_v, d]
        o, new = deltanet.delta_rule_recurrent(
            q, k, v, g[:, None], beta[:, None], ssm.index_select(0, idx)
        )
        ssm.index_copy_(0, idx, new)
        return o[:, 0]

    def gated_norm(
        self,
        o: torch.Tensor,  # [N, H_v, d_v]
        z: torch.Tensor,  # [N, H_v * d_v] output gate (before its activation)
        w: torch.Tensor,  # [d_v]
        eps: float,
        sigmoid: bool,
    ) -> torch.Tensor:  # [N, H_v * d_v]
        """rms_norm(o, w) * act(z) per value head, act = sigmoid (qwen4exp) or silu (qwen3next):
        ``deltanet.output`` without the out projection."""
        check_f32("o", o)
        check_f32("z", z)
        check_f32("w", w)
        if o.dim() != 3:
            raise shape_error("o", o, "[N, H_v, d_v]")
        n, hv, dv = o.shape
        if z.shape != (n, hv * dv):
            raise shape_error("z", z, f"[{n}, {hv * dv}]")
        if w.shape != (dv,):
            raise shape_error("w", w, f"[{dv}]")
        act = rowwise.sigmoid if sigmoid else rowwise.silu
        return (ops.rms_norm(o, w, eps) * act(z).view(n, hv, dv)).reshape(n, hv * dv)

    def delta_prefill(
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
        c = _deltanet_dims(n_k_heads, n_v_heads, head_dim)
        _check_conv(qkv, conv, weight)
        if qkv.shape[1] != c or qkv.shape[0] < 1:
            raise shape_error("qkv", qkv, f"[T >= 1, {c}]")
        t = qkv.shape[0]
        _check_gb(g, beta, t, n_v_heads)
        _check_ssm(ssm, n_v_heads, head_dim)
        if not 0 <= slot < conv.shape[0] or conv.shape[0] != ssm.shape[0]:
            raise ValueError(
                f"slot {slot} out of range (conv has {conv.shape[0]} slots, ssm {ssm.shape[0]})"
            )
        y, new_conv = deltanet.causal_conv(qkv[None], conv[slot : slot + 1], weight)
        y = rowwise.silu(y[0])  # [T, C]
        q, k, v = _split_qkv(y, n_k_heads, n_v_heads, head_dim, eps)  # [T, H_v, d]
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


def _rows(x: torch.Tensor, d: int) -> tuple[torch.Tensor, int, int]:
    """x seen as [rows, d] with unit stride along d: (tensor, rows, row stride in elements).
    A contiguous tensor or a 2-D view with evenly spaced rows (a column slice of a wider
    activation) is read in place; anything else is copied to a contiguous tensor first."""
    if not x.is_contiguous() and not (x.dim() == 2 and x.stride(1) == 1):
        x = x.contiguous()
    if x.is_contiguous():
        return x, (x.numel() // d if d else 0), d
    return x, x.shape[0], x.stride(0)


def _vec4_ok(*pairs: tuple[torch.Tensor, int]) -> bool:
    """Whether every tensor is 16-byte aligned and every given stride a multiple of 4 floats."""
    return all(t.data_ptr() % 16 == 0 and s % 4 == 0 for t, s in pairs)


class SmallOpsCuda(CudaBase, SmallOpsTorch):
    """The small ops as NVRTC kernels on torch's current stream. Inputs must be float32 (int32 for
    positions / slots) on this device; outputs are new contiguous tensors."""

    def _f32(self, name: str, t: torch.Tensor) -> None:
        check_cuda(name, t, self.device, torch.float32)

    def _small_i32(self, name: str, t: torch.Tensor) -> None:
        check_cuda(name, t, self.device, torch.int32)

    def _norm_rows(
        self,
        x: torch.Tensor,  # [rows, D] (see _rows)
        w: torch.Tensor,  # [G, D] contiguous
        eps: float,
        z: torch.Tensor | None,  # gate (r, i) at (r // z_group) * z_stride + (r % z_group) * D + i
        z_group: int,
        gate: int,
    ) -> torch.Tensor:  # [rows * D] flat, contiguous
        d = w.shape[-1]
        x, n_rows, x_stride = _rows(x, d)
        n_groups = w.numel() // d
        z_stride = 0
        if z is not None:
            z, _, z_stride = _rows(z, z.shape[-1])
        y = torch.empty(n_rows * d, dtype=torch.float32, device=self.device)
        if n_rows == 0 or d == 0:
            return y
        pairs = [(x, x_stride), (w, d), (y, d)] + ([(z, z_stride)] if z is not None else [])
        vec = d % 4 == 0 and _vec4_ok(*pairs)
        per_thread = d // 4 if vec else d
        tpr = 32
        while tpr < 256 and tpr * 2 <= per_thread:  # ~2 loads per thread, 32..256 per row
            tpr *= 2
        rpc = max(1, 256 // tpr)
        name = "rms_norm_f32_v4" if vec else "rms_norm_f32"
        self.launch(
            self.kernel(NORM_SOURCE, name),
            (n_rows + rpc - 1) // rpc,
            (tpr, rpc),
            x.data_ptr(),
            np.int64(x_stride),
            w.data_ptr(),
            np.int32(n_groups),
            z.data_ptr() if z is not None else 0,
            np.int32(z_group),
            np.int64(z_stride),
            y.data_ptr(),
            np.int32(n_rows),
            np.int32(d),
            np.float32(eps),
            np.int32(gate),
        )
        return y

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        _check_norm(x, w)
        check_cuda("w", w, self.device, torch.float32)
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, expected {self.device}")
        return self._norm_rows(x, w, eps, None, 1, _GATE_NONE).view(x.shape)

    def gated_norm(
        self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, sigmoid: bool
    ) -> torch.Tensor:
        self._f32("o", o)
        self._f32("w", w)
        if z.device != self.device or z.dtype != torch.float32:
            raise ValueError(f"z must be float32 on {self.device}")
        if o.dim() != 3:
            raise shape_error("o", o, "[N, H_v, d_v]")
        n, hv, dv = o.shape
        if z.shape != (n, hv * dv):
            raise shape_error("z", z, f"[{n}, {hv * dv}]")
        if w.shape != (dv,):
            raise shape_error("w", w, f"[{dv}]")
        gate = _GATE_SIGMOID if sigmoid else _GATE_SILU
        return self._norm_rows(o, w, eps, z, hv, gate).view(n, hv * dv)

    def _rope(
        self,
        x: torch.Tensor,
        w: torch.Tensor | None,
        eps: float,
        pos: torch.Tensor,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float,
        freq_factors: torch.Tensor | None,
    ) -> torch.Tensor:
        _check_rope(x, pos, n_rot, freq_factors)
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, expected {self.device}")
        if x.stride(2) != 1:  # heads are read with any token / head strides, but dims in order
            x = x.contiguous()
        self._small_i32("pos", pos)
        n, h, d = x.shape
        if d > ROPE_MAX_DIM:
            raise ValueError(f"rope: head dim {d} > {ROPE_MAX_DIM}")
        if w is not None:
            self._f32("w", w)
            if w.shape != (d,):
                raise shape_error("w", w, f"[{d}] (one weight for every head)")
        if freq_factors is not None:
            self._f32("freq_factors", freq_factors)
        inv = self.inv_freq(n_rot, base, self.device)
        y = torch.empty((n, h, d), dtype=torch.float32, device=self.device)
        if y.numel() == 0:
            return y
        shmem = (n_rot + ROPE_WARPS * d) * 4  # cos, sin [n_rot / 2] each; one head row per warp
        self.launch(
            self.kernel(NORM_SOURCE, "rms_norm_rope_f32"),
            (n, (h + ROPE_WARPS - 1) // ROPE_WARPS),
            32 * ROPE_WARPS,
            x.data_ptr(),
            np.int64(x.stride(0)),
            np.int64(x.stride(1)),
            w.data_ptr() if w is not None else 0,
            y.data_ptr(),
            pos.data_ptr(),
            inv.data_ptr(),
            freq_factors.data_ptr() if freq_factors is not None else 0,
            np.int32(h),
            np.int32(d),
            np.int32(n_rot),
            np.int32(1 if neox else 0),
            np.float64(scale),
            np.float32(eps),
            shmem=shmem,
        )
        return y

    def rope(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._rope(x, None, 0.0, pos, n_rot, base, neox, scale, freq_factors)

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        eps: float,
        pos: torch.Tensor,
        *,
        n_rot: int,
        base: float,
        neox: bool,
        scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_f32("w", w)
        if w.dim() != 1:
            raise shape_error("w", w, f"[{x.shape[-1]}] (one weight for every head)")
        return self._rope(x, w, eps, pos, n_rot, base, neox, scale, freq_factors)

    def _act(self, name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_gate_pair(gate, up)
        for t_name, t in (("gate", gate), ("up", up)):
            if t.device != self.device:
                raise ValueError(f"{t_name} is on {t.device}, expected {self.device}")
        f = gate.shape[-1] if gate.dim() else 1
        gate, n_rows, g_stride = _rows(gate, f)
        up, _, u_stride = _rows(up, f)
        out = torch.empty(gate.shape, dtype=torch.float32, device=self.device)
        if out.numel() == 0:
            return out
        vec = f % 4 == 0 and _vec4_ok((gate, g_stride), (up, u_stride), (out, f))
        per_row = f // 4 if vec else f
        self.launch(
            self.kernel(ACT_SOURCE, f"{name}_f32{'_v4' if vec else ''}"),
            (n_rows, (per_row + ACT_THREADS - 1) // ACT_THREADS),
            ACT_THREADS,
            gate.data_ptr(),
            np.int64(g_stride),
            up.data_ptr(),
            np.int64(u_stride),
            out.data_ptr(),
            np.int32(f),
        )
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._act("silu_mul", gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._act("gelu_mul", gate, up)

    def conv_step(
        self, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        k = _check_conv(x, conv, weight)
        for name, t in (("x", x), ("conv", conv), ("weight", weight)):
            self._f32(name, t)
        b, c = x.shape
        check_index("slots", slots, b)
        self._small_i32("slots", slots)
        if k > MAX_CONV_K:
            raise ValueError(f"conv kernel width {k} > {MAX_CONV_K}")
        out = torch.empty((b, c), dtype=torch.float32, device=self.device)
        if b == 0:
            return out
        vec = "1" if weight.data_ptr() % 16 == 0 else "0"  # [C, 4] rows as float4 (K = 4)
        self.launch(
            self.kernel(DELTANET_SOURCE, "conv_step_f32", (("CONV_K", str(k)), ("CONV_VEC", vec))),
            ((c + CONV_THREADS - 1) // CONV_THREADS, b),
            CONV_THREADS,
            x.data_ptr(),
            conv.data_ptr(),
            slots.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            np.int32(c),
        )
        return out

    def delta_step(
        self,
        y: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: torch.Tensor,
        slots: torch.Tensor,
        *,
        n_k_heads: int,
        n_v_heads: int,
        head_dim: int,
        eps: float,
    ) -> torch.Tensor:
        c = _deltanet_dims(n_k_heads, n_v_heads, head_dim)
        # per-token rows read in place; views (rowwise's padded outputs, slices) are copied
        y, g, beta = (t if t.is_contiguous() else t.contiguous() for t in (y, g, beta))
        for name, t in (("y", y), ("g", g), ("beta", beta), ("ssm", ssm)):
            self._f32(name, t)
        if y.dim() != 2 or y.shape[1] != c:
            raise shape_error("y", y, f"[B, {c}]")
        b = y.shape[0]
        _check_gb(g, beta, b, n_v_heads)
        _check_ssm(ssm, n_v_heads, head_dim)
        check_index("slots", slots, b)
        self._small_i32("slots", slots)
        if head_dim > 256:
            raise ValueError(f"delta_step: head_dim {head_dim} > 256 (state column in registers)")
        o = torch.empty((b, n_v_heads, head_dim), dtype=torch.float32, device=self.device)
        if b == 0:
            return o
        self.launch(
            self.kernel(DELTANET_SOURCE, "delta_step_f32", (("HEAD_DIM", str(head_dim)),)),
            ((head_dim + DELTA_COLS - 1) // DELTA_COLS, n_v_heads, b),
            (DELTA_COLS, DELTA_SPLIT),
            y.data_ptr(),
            g.data_ptr(),
            beta.data_ptr(),
            ssm.data_ptr(),
            slots.data_ptr(),
            o.data_ptr(),
            np.int32(n_k_heads),
            np.int32(n_v_heads),
            np.float32(eps),
            np.float32(head_dim**-0.5),
        )
        return o
