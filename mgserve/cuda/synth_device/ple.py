"""The synthetic PLE table (``per_layer_token_embd``, hundreds of MB to ~54 GB) on the host, as
``GGUFFile`` keeps it: a pool of random rows repeated, materialised when the table is small,
otherwise one memfd pool mapped over and over into a contiguous read-only address range, so even
the real ~320M-row table costs 32 MiB of memory."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mgserve.cuda.synth_device.blocks import make_blocks

PLE_TILE_BYTES = 32 << 20  # the PLE table repeats with this period (about)
PLE_MATERIALIZE_BYTES = 256 << 20  # larger tables: one memfd pool mapped many times (Linux)


class TiledMapping:
    """A read-only address range that repeats one memfd pool: numpy's ``__array_interface__``
    over it gives a [rows, row bytes] array whose ``base`` is this object (so the mapping lives as
    long as any view). ``_mmap`` is None so ``ple_rows.advise_random`` stops here."""

    _mmap = None
    base = None

    def __init__(self, pool: np.ndarray, total_bytes: int, shape: tuple[int, int]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        ]  # fmt: skip
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._munmap = libc.munmap
        tile = pool.nbytes
        n_tiles = -(-total_bytes // tile)
        self._size = n_tiles * tile
        prot_none, prot_read, map_shared, map_private = 0, 1, 0x01, 0x02
        map_fixed, map_anonymous, map_noreserve = 0x10, 0x20, 0x4000
        fd = os.memfd_create("mgserve-synth-ple")
        try:
            os.ftruncate(fd, tile)
            view = memoryview(pool.reshape(-1))  # type: ignore[arg-type]  # ndarray is a buffer
            done = 0
            while done < tile:
                done += os.pwrite(fd, view[done:], done)
            flags = map_private | map_anonymous | map_noreserve
            addr = libc.mmap(None, self._size, prot_none, flags, -1, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                raise OSError(ctypes.get_errno(), "mmap of the PLE address range failed")
            self._addr = addr
            for i in range(n_tiles):
                at = addr + i * tile
                got = libc.mmap(at, tile, prot_read, map_shared | map_fixed, fd, 0)
                if got != at:
                    err = ctypes.get_errno()
                    self.close()
                    raise OSError(err, f"mmap of PLE tile {i} of {n_tiles} failed")
        finally:
            os.close(fd)  # the mappings keep the memfd alive
        self.__array_interface__ = {
            "shape": shape,
            "typestr": "|u1",
            "data": (addr, True),  # read-only
            "version": 3,
        }

    def close(self) -> None:
        if getattr(self, "_addr", None):
            self._munmap(self._addr, self._size)
            self._addr = None

    def __del__(self) -> None:
        self.close()


def _tiled_table(pool: np.ndarray, rows: int) -> np.ndarray:
    """uint8 [rows, row bytes]: ``pool`` [P, row bytes] repeated, as a host array."""
    p, rb = pool.shape
    mappable = sys.platform.startswith("linux") and pool.nbytes % mmap.PAGESIZE == 0
    if rows * rb <= PLE_MATERIALIZE_BYTES or not mappable:
        out = np.empty((rows, rb), dtype=np.uint8)
        for i in range(0, rows, p):
            n = min(p, rows - i)
            out[i : i + n] = pool[:n]
        out.flags.writeable = False
        return out
    return np.asarray(TiledMapping(pool, rows * rb, (rows, rb)))


def ple_table_data(type_name: str, shape: tuple[int, ...], gen: torch.Generator) -> np.ndarray:
    """The PLE table's host data in GGUFFile's layout (uint8 [rows, row bytes] for a quant type),
    a pool of about ``PLE_TILE_BYTES`` of random rows repeated. The pool's byte size is a multiple
    of the page size so the memfd path can map it back to back."""
    width, rows = shape
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rb = width // block * size
    period = math.lcm(rb, mmap.PAGESIZE) // rb  # rows per page-aligned unit
    pool_rows = min(rows, period * max(1, PLE_TILE_BYTES // (period * rb)))
    blocks = make_blocks(type_name, pool_rows * rb // size, "cpu", gen)
    pool = blocks.numpy().reshape(pool_rows, rb)
    table = _tiled_table(pool, rows)
    if type_name in ("F32", "F16"):
        return table.view(np.float32 if type_name == "F32" else np.float16)
    return table
