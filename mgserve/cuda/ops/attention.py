"""The attention family: dense and sliding-window attention over the slot pools, decode (one
query per session) and prefill (one session's chunk of queries).

A decode query of session b sits at position ``lengths[b] - 1`` and sees positions
``0 .. lengths[b] - 1`` of slot ``slots[b]`` (the last ``window`` of them for sliding-window
layers); query head h reads KV head ``h // (H / n_kv)``. A session with length 0 (a padding row)
gets zeros. ``AttentionTorch`` equals ``mgserve.core.reference.ops.attention`` on the dequantized
pools to float rounding; it masks over all ``n_ctx`` positions in decode (static shapes: it
captures into CUDA graphs) and works in memory-bounded query chunks in prefill.
``AttentionCuda`` (attention_cuda.py) runs the kernels.
"""

from __future__ import annotations

import torch

from mgserve.cuda.checks import check_f32, check_index, shape_error
from mgserve.cuda.ops.kv import check_kv, check_span, dequant
from mgserve.cuda.pools import KVLayer

_SCORE_ELEMS = 1 << 26  # bound on the [.., T, S] score elements of one torch prefill chunk
NEG_INF = float("-inf")


def check_q(q: torch.Tensor, n_kv: int, d: int, what: str) -> tuple[int, int]:
    """(rows, heads) of q [rows, H, D] float32 with H a multiple of n_kv."""
    check_f32("q", q)
    if q.dim() != 3 or q.shape[2] != d:
        raise shape_error("q", q, f"[{what}, H, {d}] (head_dim of the pools)")
    if q.shape[1] % n_kv:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the {n_kv} KV heads")
    return q.shape[0], q.shape[1]


def _attend(
    q: torch.Tensor,  # [T, H, D]
    kf: torch.Tensor,  # [S, Hkv, D] float32
    vf: torch.Tensor,
    visible: torch.Tensor,  # [T, S] bool
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [T, H * D]
    """Masked softmax attention with grouped KV heads; rows with nothing visible give zeros."""
    t, h, d = q.shape
    n_kv = kf.shape[1]
    scores = torch.einsum("tkgd,skd->kgts", q.view(t, n_kv, h // n_kv, d), kf) * scale
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, NEG_INF)  # [Hkv, G, T, S]
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("kgts,skd->tkgd", probs, vf).reshape(t, h * d)


class AttentionTorch:
    """Attention in plain PyTorch on the pools' device (static shapes for decode)."""

    def decode(
        self,
        q: torch.Tensor,  # [B, H, D] float32
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,  # [B] int32
        lengths: torch.Tensor,  # [B] int32
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [B, H * D]
        """One query per session over its slot's first ``lengths[b]`` positions (a mask over
        all n_ctx positions: static shapes, one session at a time to bound memory)."""
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        b, _ = check_q(q, n_kv, d, "B")
        check_index("slots", slots, b)
        check_index("lengths", lengths, b)
        key_pos = torch.arange(n_ctx, device=q.device)
        outs = []
        for i in range(b):
            s = slots[i : i + 1].long()
            kf, vf = dequant(k, s)[0], dequant(v, s)[0]  # [n_ctx, Hkv, D]
            length = lengths[i].long()
            visible = key_pos < length
            if window > 0:
                visible &= length - 1 - key_pos < window
            outs.append(_attend(q[i : i + 1], kf, vf, visible[None], scale, softcap))
        if not outs:
            return q.new_zeros((0, q.shape[1] * d))
        return torch.cat(outs)

    def prefill(
        self,
        q: torch.Tensor,  # [T, H, D] float32
        k: KVLayer,
        v: KVLayer,
        slot: int,
        start: int,
        *,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [T, H * D]
        """One session's chunk: query j at position start + j sees keys 0..start+j (already
        written), in query chunks that bound the score matrix."""
        n_slots, n_ctx, n_kv, d = check_kv(k, v)
        t, h = check_q(q, n_kv, d, "T")
        check_span(n_ctx, n_slots, slot, start, t)
        end = start + t
        k0 = max(0, start - window + 1) if window > 0 else 0  # no query sees keys before k0
        kf = dequant(k, slot, slice(k0, end))  # [S, Hkv, D]
        vf = dequant(v, slot, slice(k0, end))
        key_pos = torch.arange(k0, end, device=q.device)
        chunk = max(1, _SCORE_ELEMS // max(1, h * (end - k0)))
        outs = []
        for c in range(0, t, chunk):
            q_pos = torch.arange(start + c, start + min(t, c + chunk), device=q.device)
            visible = key_pos[None, :] <= q_pos[:, None]
            if window > 0:
                visible &= q_pos[:, None] - key_pos[None, :] < window
            outs.append(_attend(q[c : c + chunk], kf, vf, visible, scale, softcap))
        if not outs:
            return q.new_zeros((0, h * d))
        return torch.cat(outs)
