"""The PLE table's rows (qwen4exp's n-gram embedding, ple.py): read from the memory-mapped table
only as asked for, decoded on the host (numpy: ``gather_rows``, ``decode_blocks``) or kept as
stored (``packed_rows``) and decoded where they are used (torch: ``unpack_rows``, on the GPU for
a prompt chunk). Every path gives the bits of gguf's numpy dequantization."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from mgserve.core.gguf.reader import TensorInfo


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
    elif t.type_name in NUMPY_BLOCKS and raw.dtype == np.uint8:
        values = decode_blocks(raw, t.type_name)
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


NUMPY_BLOCKS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
_LEAD = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "IQ4_NL": 2}  # bytes before the nibbles
_BIT = np.arange(32, dtype=np.uint32)
_IQ4_NL_F32 = np.array(IQ4_NL_VALUES, dtype=np.float32)


def decode_blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [R, values] of rows of 32-value blocks ``raw`` uint8 [R, row bytes] (a type of
    ``NUMPY_BLOCKS``): ``unpack_rows``' arithmetic in numpy, bitwise gguf's dequantization
    (each value one float32 product of exact operands, plus the minimum for the _1 types) at a
    fraction of its per-call cost for the few rows of a decode step."""
    block = PACKED[type_name][0]
    if raw.shape[0] == 0:  # an empty step
        return np.zeros((0, raw.shape[1] // block * 32), dtype=np.float32)
    b = raw.reshape(-1, block)  # [blocks, block bytes]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    if type_name == "Q8_0":
        return (d * b[:, 2:].view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)
    lead = _LEAD[type_name]
    qs = b[:, lead:]  # value j's low 4 bits in byte j % 16, j >= 16 in the high half
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=1)  # uint8 [blocks, 32]
    if type_name == "IQ4_NL":
        out = d * _IQ4_NL_F32[q]
    else:
        if type_name in ("Q5_0", "Q5_1"):  # the fifth bits: bit j of a little-endian uint32
            qh = b[:, lead - 4 : lead].copy().view("<u4")  # [blocks, 1]
            q = q | (((qh >> _BIT) & 1).astype(np.uint8) << 4)
        if type_name in ("Q4_0", "Q5_0"):
            out = d * (q.astype(np.float32) - (8 if type_name == "Q4_0" else 16))
        else:  # d * q + m, two roundings
            out = d * q.astype(np.float32) + b[:, 2:4].copy().view(np.float16).astype(np.float32)
    return out.reshape(raw.shape[0], -1)


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
    lead = _LEAD[type_name]
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
