"""PLE, qwen4exp's n-gram hash embedding: each token looks up ``n_heads`` rows of one huge table
(~51B parameters in the real model) by hashing itself and the tokens before it, and the layer
mixes them into every hyper-connection stream.

Hash (host side, as llama.cpp's ``llm_graph_input_qwen4exp_ple`` and HF
``Qwen4ExpTextNGramEmbedding``): ctx[0] is the token, ctx[s] the token s positions back; a missing
predecessor or an EOS in the window turns it and everything further back into EOS (the token's own
EOS does not cut). For n = 2..ngram, ``mixed = XOR_j ctx[j] * m[j]`` over j < n (each product stays
below 2^63, so signed and unsigned arithmetic agree) and head h of that n-gram reads row
``mixed % size[h] + offset[h]``.

The table stays memory-mapped: ``ple_rows.gather_rows`` copies and dequantizes only the rows asked
for.

Layer (HF ``Qwen4ExpTextPLELayer``, llama.cpp ``build_ple``), streams x [hc, d], e the token's
concatenated rows::

    key   = grouped_norm(W_key e)          [hc, d]     value = W_value e   [d]
    s     = <key, grouped_norm(x)> / sqrt(d) per stream; gate = sigmoid(sign(s) sqrt(|s|))
    g     = gate * value                    [hc, d]
    x    += g + silu(dilated_causal_conv(grouped_norm(g)))   (dilation ngram, history in state)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from mgserve.core.gguf.hparams_qwen4exp import PleSpec
from mgserve.core.gguf.reader import GGUFError, TensorInfo
from mgserve.core.reference import ops, rowwise
from mgserve.core.reference.dequant import SUPPORTED_TYPES


def ngram_rows(tokens: np.ndarray, history: np.ndarray, ple: PleSpec) -> np.ndarray:
    """[T, n_heads] int64 table rows for ``tokens`` [T], preceded by ``history`` [ngram - 1]
    (oldest first; EOS where the session has no such token)."""
    return hash_contexts(ngram_contexts(tokens, history, ple), ple)


def ngram_contexts(tokens: np.ndarray, history: np.ndarray, ple: PleSpec) -> np.ndarray:
    """[ngram, T] int64: row s holds, for each of ``tokens`` [T], the token s positions back
    (``history`` [ngram - 1] before the first, oldest first), EOS from an EOS back on."""
    back = ple.ngram - 1
    seq = np.concatenate([history, tokens]).astype(np.int64)  # [back + T]
    t = tokens.shape[0]
    ctx = np.empty((ple.ngram, t), dtype=np.int64)  # ctx[s]: the token s positions back
    ctx[0] = tokens
    cut = np.zeros(t, dtype=bool)
    for s in range(1, ple.ngram):
        prev = seq[back - s : back - s + t]
        cut |= prev == ple.eos
        ctx[s] = np.where(cut, ple.eos, prev)
    return ctx


def decode_contexts(tokens: np.ndarray, histories: np.ndarray, ple: PleSpec) -> np.ndarray:
    """``ngram_contexts`` of one token per session at once: [ngram, S] for ``tokens`` [S], each
    after its session's ``histories`` row [S, ngram - 1] (oldest first), the same columns as S
    calls of ``ngram_contexts`` joined (a decode step's host work: no loop over sessions)."""
    back = ple.ngram - 1
    ctx = np.empty((ple.ngram, tokens.shape[0]), dtype=np.int64)
    ctx[0] = tokens
    cut = np.zeros(tokens.shape[0], dtype=bool)
    for s in range(1, ple.ngram):
        prev = histories[:, back - s]
        cut |= prev == ple.eos
        ctx[s] = np.where(cut, ple.eos, prev)
    return ctx


@functools.lru_cache(maxsize=8)
def _hash_consts(ple: PleSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(multipliers [ngram, 1], sizes [n_heads, 1] as uint64; offsets [n_heads, 1] int64)."""
    return (
        np.array(ple.multipliers, dtype=np.uint64)[:, None],
        np.array(ple.sizes, dtype=np.uint64)[:, None],
        np.array(ple.offsets, dtype=np.int64)[:, None],
    )


def hash_contexts(ctx: np.ndarray, ple: PleSpec) -> np.ndarray:
    """[T, n_heads] int64 table rows of the contexts ``ctx`` [ngram, T] (``ngram_contexts``; the
    columns of several sessions may be joined, so a decode step hashes once). Head h reads the
    n-gram of n = 2 + h // heads_per_ngram tokens: the XOR of its first n products."""
    mult, sizes, offsets = _hash_consts(ple)
    prods = ctx.astype(np.uint64) * mult  # [ngram, T], each < 2^63
    mixed = np.bitwise_xor.accumulate(prods, axis=0)[1:]  # [ngram - 1, T]: n = 2 .. ngram
    heads = np.repeat(mixed, ple.heads_per_ngram, axis=0)  # [n_heads, T]
    return np.ascontiguousarray(((heads % sizes).astype(np.int64) + offsets).T)


def check_table(t: TensorInfo, ple: PleSpec, path: object) -> None:
    """GGUFError unless ``t`` is a table every head's row range fits."""
    need = max(o + s for o, s in zip(ple.offsets, ple.sizes, strict=True))
    if len(t.shape) != 2 or t.shape[0] != ple.head_dim or t.shape[1] < need:
        raise GGUFError(
            f"{path}: tensor {t.name!r} has shape {list(t.shape)}, expected "
            f"[{ple.head_dim}, >= {need}] for the PLE head ranges"
        )
    if t.type_name not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {t.name!r} has unsupported type {t.type_name}")


@dataclass
class PleWeights:  # [out, in] float32
    key: torch.Tensor  # [hc * d, n_heads * head_dim]
    value: torch.Tensor  # [d, n_heads * head_dim]
    norm_key: torch.Tensor  # [hc, d] (1 + w)
    norm_query: torch.Tensor  # [hc, d]
    norm_conv: torch.Tensor  # [hc, d]
    conv: torch.Tensor  # [hc * d, kernel] depthwise, dilated by ngram


def gated_values(
    x: torch.Tensor, emb: torch.Tensor, w: PleWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # gated [N, hc, d], conv input [N, hc * d]
    """Token-wise part: each stream's gate on the shared value, and the conv's normalised input."""
    key, value = ops.linear(emb, w.key), ops.linear(emb, w.value)  # [N, hc * d], [N, d]
    return gate_values(x, key, value, w.norm_key, w.norm_query, w.norm_conv, eps)


def gate_values(
    x: torch.Tensor,  # [N, hc, d] streams
    key: torch.Tensor,  # [N, hc * d] W_key e
    value: torch.Tensor,  # [N, d] W_value e
    norm_key: torch.Tensor,  # [hc, d]
    norm_query: torch.Tensor,
    norm_conv: torch.Tensor,
    eps: float,
    norm: ops.NormFn = ops.rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:  # gated [N, hc, d], conv input [N, hc * d]
    """``gated_values`` from the projected key and value, with the norm given as a function: the
    device backend runs this same arithmetic on its own products and norm kernel."""
    n, hc, d = x.shape
    key = norm(key.view(n, hc, d), norm_key, eps)
    query = norm(x, norm_query, eps)
    s = rowwise.tree_sum(key * query) / math.sqrt(d)  # [N, hc]
    gate = rowwise.sigmoid(torch.sign(s) * s.abs().clamp_min(1e-6).sqrt())
    gated = gate[:, :, None] * value[:, None, :]  # [N, hc, d]
    return gated, norm(gated, norm_conv, eps).reshape(n, hc * d)


def dilated_conv(
    x: torch.Tensor,  # [..., T, C] new conv inputs (of one session, or a batch of sessions)
    state: torch.Tensor,  # [..., (K - 1) * dil, C] previous inputs, oldest first (zeros at start)
    weight: torch.Tensor,  # [C, K]
    dilation: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # silu(y) [..., T, C], new state
    """y_t = sum_k w[:, k] x_{t - (K - 1 - k) * dilation}, then silu."""
    hist, t, k = state.shape[-2], x.shape[-2], weight.shape[1]
    xp = torch.cat((state, x), dim=-2)  # [..., hist + T, C]
    y = torch.zeros_like(x)
    for j in range(k):
        start = hist - (k - 1 - j) * dilation
        y = y + xp[..., start : start + t, :] * weight[:, j]
    return rowwise.silu(y), xp[..., xp.shape[-2] - hist :, :].clone()
