"""PLE, qwen4exp's n-gram hash embedding: each token looks up ``n_heads`` rows of one huge table
(~51B parameters in the real model) by hashing itself and the tokens before it, and the layer
mixes them into every hyper-connection stream.

Hash (host side, as llama.cpp's ``llm_graph_input_qwen4exp_ple`` and HF
``Qwen4ExpTextNGramEmbedding``): ctx[0] is the token, ctx[s] the token s positions back; a missing
predecessor or an EOS in the window turns it and everything further back into EOS (the token's own
EOS does not cut). For n = 2..ngram, ``mixed = XOR_j ctx[j] * m[j]`` over j < n (each product stays
below 2^63, so signed and unsigned arithmetic agree) and head h of that n-gram reads row
``mixed % size[h] + offset[h]``.

The table stays memory-mapped: ``gather_rows`` copies and dequantizes only the rows asked for.

Layer (HF ``Qwen4ExpTextPLELayer``, llama.cpp ``build_ple``), streams x [hc, d], e the token's
concatenated rows::

    key   = grouped_norm(W_key e)          [hc, d]     value = W_value e   [d]
    s     = <key, grouped_norm(x)> / sqrt(d) per stream; gate = sigmoid(sign(s) sqrt(|s|))
    g     = gate * value                    [hc, d]
    x    += g + silu(dilated_causal_conv(grouped_norm(g)))   (dilation ngram, history in state)
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

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


def hash_contexts(ctx: np.ndarray, ple: PleSpec) -> np.ndarray:
    """[T, n_heads] int64 table rows of the contexts ``ctx`` [ngram, T] (``ngram_contexts``; the
    columns of several sessions may be joined, so a decode step hashes once)."""
    mult = np.array(ple.multipliers, dtype=np.uint64)
    prods = ctx.astype(np.uint64) * mult[:, None]  # [ngram, T], each < 2^63
    rows = np.empty((ctx.shape[1], ple.n_heads), dtype=np.int64)
    for n in range(2, ple.ngram + 1):
        mixed = np.bitwise_xor.reduce(prods[:n], axis=0)  # [T]
        for g in range(ple.heads_per_ngram):
            h = (n - 2) * ple.heads_per_ngram + g
            rows[:, h] = (mixed % np.uint64(ple.sizes[h])).astype(np.int64) + ple.offsets[h]
    return rows


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


def advise_random(t: TensorInfo) -> bool:
    """Tell the kernel that ``t``'s pages are read at random, so a row read maps the page it
    needs instead of a 64 KiB fault-around / readahead window (which, for 16 scattered rows per
    token, would grow the mapped (resident) part of the table by ~1 MiB per token). False when
    the data is not an mmap or the platform has no madvise."""
    base: Any = t.data
    while base is not None and not hasattr(base, "_mmap"):
        base = base.base
    mm = getattr(base, "_mmap", None)
    if not isinstance(mm, mmap.mmap) or not hasattr(mmap, "MADV_RANDOM"):
        return False
    start = t.offset - t.offset % mmap.PAGESIZE
    mm.madvise(mmap.MADV_RANDOM, start, t.offset + t.n_bytes - start)
    return True


def gather_rows(t: TensorInfo, rows: np.ndarray) -> torch.Tensor:
    """[*rows.shape, row width] float32: the table rows ``rows``, read from the memory map."""
    flat = rows.reshape(-1)
    raw = np.asarray(t.data[flat])  # [R, row bytes or elements]: copies only these rows
    if t.type_name == "F32":
        values = raw.astype(np.float32, copy=False)
    elif t.type_name == "F16":
        values = raw.astype(np.float32)
    else:
        values = quants.dequantize(raw, GGMLQuantizationType(t.type_id))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(
        *rows.shape, t.shape[0]
    )


# Table types whose rows ``unpack_rows`` decodes with torch ops on any device, bitwise as
# ``gather_rows`` (gguf's numpy dequantization): bytes per block and values per block. A row of
# ``head_dim`` values (160 in the real model) takes 32-value blocks only, so these are every type
# such a table can have but MXFP4 (llama-quantize's fallbacks for rows that are no multiple of 256
# are Q5_0, Q5_1, Q8_0, Q4_0 and IQ4_NL; a type not here takes the float rows). Bitwise for every
# value but NaNs, whose payloads torch may quiet. Each value is one float32 product of exact
# operands (a f16 scale times a small integer) plus, for the _1 types, the f16 minimum in a second
# rounding, as numpy computes it.
PACKED = {
    "F32": (4, 1),
    "F16": (2, 1),
    "BF16": (2, 1),
    "Q8_0": (34, 32),
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "IQ4_NL": (18, 32),
}
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


_IQ4_NL_GRIDS: dict[torch.device, torch.Tensor] = {}


def _iq4_nl_grid(device: torch.device) -> torch.Tensor:
    """IQ4_NL_VALUES as float32 on ``device``, made once: a tensor made from a list on a GPU is
    a copy from pageable memory, which waits for the GPU (and cannot be graph-captured)."""
    grid = _IQ4_NL_GRIDS.get(device)
    if grid is None:
        grid = _IQ4_NL_GRIDS[device] = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32).to(device)
    return grid


def packed_rows(t: TensorInfo, rows: np.ndarray) -> torch.Tensor | None:
    """The table rows ``rows`` [N, heads] as stored: uint8 [N, heads * row bytes] (a quarter to
    a seventh of ``gather_rows``' float32 for the quantized types), decoded where they are used
    (``unpack_rows``, on the GPU for a prompt chunk); None for a type it does not decode."""
    if t.type_name not in PACKED or not t.data.dtype.isnative:  # unpack_rows reads native order
        return None
    n, heads = rows.shape
    table = np.asarray(t.data).reshape(t.shape[1], -1).view(np.uint8)  # [rows, row bytes]
    raw = np.take(table, rows.reshape(-1), axis=0)  # [N * heads, row bytes]: only these rows
    return torch.from_numpy(raw).view(n, heads * table.shape[1])


def unpack_rows(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 [N, heads * head_dim] from ``packed_rows``' bytes, on their device."""
    block, per = PACKED[type_name]
    n, blocks = raw.shape[0], raw.shape[1] // block
    b = raw.reshape(n, blocks, block)
    if per == 1:
        if type_name == "F32":
            return b.contiguous().view(torch.float32).view(n, blocks)
        dtype = torch.float16 if type_name == "F16" else torch.bfloat16
        return b.contiguous().view(dtype).float().view(n, blocks)

    def f16(at: int) -> torch.Tensor:  # the block's f16 at byte ``at`` as float32 [N, blocks, 1]
        return b[..., at : at + 2].contiguous().view(torch.float16).float()

    if type_name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * f16(0)).view(n, blocks * per)
    lead = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "IQ4_NL": 2}[type_name]  # before nibbles
    qs = b[..., lead:]  # 16 bytes: value j's low 4 bits in byte j % 16, j >= 16 in the high half
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(torch.int32)  # [N, blocks, 32]
    if type_name == "IQ4_NL":  # d times the nibble's entry of the non-linear grid
        return (f16(0) * _iq4_nl_grid(raw.device)[q.long()]).view(n, blocks * per)
    if type_name in ("Q5_0", "Q5_1"):  # the fifth bits: bit j of a little-endian uint32
        hb = b[..., lead - 4 : lead].to(torch.int32)  # (an arithmetic shift & 1 is still bit 31)
        qh = hb[..., 0:1] | hb[..., 1:2] << 8 | hb[..., 2:3] << 16 | hb[..., 3:4] << 24
        bit = torch.arange(32, device=raw.device, dtype=torch.int32)
        q = q | (((qh >> bit) & 1) << 4)
    if type_name in ("Q4_0", "Q5_0"):  # symmetric: d * (q - 8 or 16)
        out = f16(0) * (q - (8 if type_name == "Q4_0" else 16)).float()
    else:  # d * q + m, two roundings as numpy's
        out = f16(0) * q.float() + f16(2)
    return out.view(n, blocks * per)


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
