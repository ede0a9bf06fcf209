"""Full attention of qwen3moe and qwen3next: GQA with per-head q/k RMSNorm and NeoX RoPE; qwen3next
adds an output gate and rotates only the first ``n_rot`` dims of each head.

qwen3next's ``attn_q`` projects to 2 * head_dim per head, laid out [q_h | gate_h] head by head
(llama.cpp views the first head_dim values of each head as q, the next as the gate; HF's
``torch.chunk(..., 2, dim=-1)`` on the per-head view is the same). The attention output is
multiplied by sigmoid(gate) before ``attn_output``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.models.kvcache import KVCache
from mgserve.core.reference import ops, rowwise


@dataclass
class AttnWeights:  # [out, in] float32
    wq: torch.Tensor  # [n_head * head_dim * (2 if gated else 1), n_embd]
    wk: torch.Tensor  # [n_head_kv * head_dim, n_embd]
    wv: torch.Tensor  # [n_head_kv * head_dim, n_embd]
    wo: torch.Tensor  # [n_embd, n_head * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    gated: bool  # wq carries the sigmoid output gate (qwen3next)
    bq: torch.Tensor | None = None  # [rows of wq] optional biases (llama.cpp loads them if present)
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None


def project(
    w: AttnWeights,
    h: torch.Tensor,  # [N, n_embd] normalised input, all sessions' tokens in order
    pos: torch.Tensor,  # [N] int64 positions
    spec: ModelSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token-wise: q [N, H, Dh], k and v [N, Hkv, Dh] (normed, rotated), gate [N, H * Dh]."""
    n, dh = h.shape[0], spec.head_dim
    q = ops.linear(h, w.wq, w.bq).view(n, spec.n_head, -1)  # [N, H, Dh] or [N, H, 2 Dh]
    gate = None
    if w.gated:
        q, gate = q[..., :dh], q[..., dh:].reshape(n, spec.n_head * dh)  # gate [N, H * Dh]
    k = ops.linear(h, w.wk, w.bk).view(n, spec.n_head_kv, dh)  # [N, Hkv, Dh]
    v = ops.linear(h, w.wv, w.bv).view(n, spec.n_head_kv, dh)
    q = ops.rms_norm(q, w.q_norm, spec.rms_eps)
    k = ops.rms_norm(k, w.k_norm, spec.rms_eps)
    q, k = ops.model_rope(q, pos, spec), ops.model_rope(k, pos, spec)
    return q, k, v, gate


def output(out: torch.Tensor, gate: torch.Tensor | None, w: AttnWeights) -> torch.Tensor:
    """The attention output [N, H * Dh], gated when the model has a gate, projected to [N, d]."""
    if gate is not None:
        out = out * rowwise.sigmoid(gate)
    return ops.linear(out, w.wo)


def attend(
    w: AttnWeights,
    h: torch.Tensor,  # [N, n_embd] normalised input, all sessions' tokens in order
    pos: torch.Tensor,  # [N] int64 positions
    spans: Sequence[tuple[KVCache, int, int]],  # per session: (cache, start, n_tokens)
    kv_layer: int,  # the layer's index inside the caches
    spec: ModelSpec,
) -> torch.Tensor:  # [N, n_embd]
    q, k, v, gate = project(w, h, pos, spec)
    outs, off = [], 0
    for cache, start, t in spans:
        # Write, then read back through the cache type's rounding, whatever the chunking.
        cache.write(kv_layer, start, k[off : off + t], v[off : off + t])
        keys, values = cache.read(kv_layer, start + t)  # [start + t, Hkv, Dh]
        outs.append(
            ops.attention(q[off : off + t], keys, values, pos[off : off + t], scale=spec.attn_scale)
        )
        off += t
    return output(torch.cat(outs), gate, w)  # [N, H * Dh] -> [N, n_embd]
