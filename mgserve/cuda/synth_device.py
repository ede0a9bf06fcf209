"""Synthetic full-width models made in memory, for benchmarks: no GGUF file is written or read.

``mgserve synth`` writes a random-weight GGUF (``mgserve.core.synth.write``); at full width that is
~35 GB for a 48-layer, 256-expert qwen4exp, and pushing it through the device machine's disk twice
costs minutes of scarce device time. ``SynthFile`` is the same model without the file:

- it quacks like ``GGUFFile`` (it is one, for ``isinstance``): ``metadata`` holds exactly the
  values ``GGUFFile`` would decode from the file ``write_synth`` writes for the same ``ShapeSpec``,
  ``tensors`` the same names, types and shapes;
- small tensors (at most ``HOST_MAX_ELEMENTS`` values: norm gammas, conv taps, DeltaNet gates,
  routers of few experts, ...) carry host numpy data in ``GGUFFile``'s layout, with values chosen
  per kind so a forward pass stays finite and sane (gammas near 1, ``ssm_a`` negative, ...);
- big ones (every large matrix) have ``data = None``: ``Loader.mat`` then calls ``synth_weight``,
  which makes the tensor's blocks directly on the device by tiling a per-type random pool;
- the PLE table (``per_layer_token_embd``, hundreds of MB to ~54 GB) stays on the host as
  ``GGUFFile`` keeps it, tiled from a small pool: materialised when it is small, otherwise one
  memfd pool mapped over and over into a contiguous read-only address range, so even the real
  ~320M-row table costs 32 MiB of memory.

Quant blocks are random bytes except for their fp16 scale/min fields, which are set so that the
dequantized weights have a standard deviation of roughly ``WEIGHT_STD`` and mean ~0 (the
per-type constants in ``_RECIPES`` follow from each layout's value ranges, see there); float
tensors are normal with that std. Nothing here is meant to produce meaningful text.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from mgserve.core.gguf.reader import GGUFFile, TensorInfo
from mgserve.core.gguf.writer import _NP_DTYPE, _infer_element, _infer_scalar, tensor_nbytes
from mgserve.core.synth.shapes import SHAPES, ShapeSpec, metadata
from mgserve.core.synth.tensors import tensor_plan
from mgserve.cuda.weights import QuantWeight, row_bytes

WEIGHT_STD = 0.03  # target std of every random matrix (an initialised model's magnitude)
HOST_MAX_ELEMENTS = 1 << 20  # tensors up to this many values get host data; larger: data None
HOST_POOL_BYTES = 8 << 20  # per-type host pool the small tensors are views of
DEVICE_POOL_BYTES = {"cuda": 64 << 20, "cpu": 4 << 20}  # per-type pool synth_weight tiles
PLE_TILE_BYTES = 32 << 20  # the PLE table repeats with this period (about)
PLE_MATERIALIZE_BYTES = 256 << 20  # larger tables: one memfd pool mapped many times (Linux)
_POOL_SEED = 0x5EED


@dataclass(frozen=True)
class _Recipe:
    """How to make valid random blocks of one quant type."""

    fields: tuple[int, ...]  # byte offsets of the fp16 scale (and min) fields in a block
    d: float  # centre of the block scale d; each block draws d * U[0.5, 1.5)
    min_ratio: float = 0.0  # the min field is min_ratio * d (centres the block's values on 0)


# d per type: WEIGHT_STD / (std of the integer factor that multiplies d), with random payload
# bytes; the min field (where there is one) cancels the mean of the unsigned quants.
_RECIPES: dict[str, _Recipe] = {
    "Q4_0": _Recipe((0,), 6.5e-3),  # d (q - 8), q 0..15: std 4.6 d
    "Q4_1": _Recipe((0, 2), 6.5e-3, -7.5),  # d q + m, q 0..15
    "Q5_0": _Recipe((0,), 3.3e-3),  # d (q - 16), q 0..31: std 9.2 d
    "Q5_1": _Recipe((0, 2), 3.3e-3, -15.5),  # d q + m, q 0..31
    "Q8_0": _Recipe((0,), 4.0e-4),  # d q, q int8: std 74 d
    "IQ4_NL": _Recipe((0,), 4.5e-4),  # d kvalue[q]: std ~66 d
    "IQ4_XS": _Recipe((0,), 2.5e-5),  # d (ls - 32) kvalue[q]: std ~1200 d
    "Q2_K": _Recipe((80, 82), 2.0e-3, 1.5),  # d (s & 15) q - dmin (s >> 4), q 0..3
    "Q3_K": _Recipe((108,), 7.0e-4),  # d (s - 32) q, s 6-bit, q -4..3: std ~42 d
    "Q4_K": _Recipe((0, 2), 1.25e-4, 7.5),  # d sc q - dmin m, sc/m 6-bit, q 0..15
    "Q5_K": _Recipe((0, 2), 6.5e-5, 15.5),  # d sc q - dmin m, q 0..31
    "Q6_K": _Recipe((208,), 2.2e-5),  # d sc (q - 32), sc int8, q 0..63: std ~1370 d
}
_FLOATS: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def supported_types() -> frozenset[str]:
    """GGML type names ``synth_weight`` / ``SynthFile`` can make data for."""
    return frozenset(_RECIPES) | frozenset(_FLOATS)


def _unit(type_name: str) -> int:
    """Bytes of one GGUF block of ``type_name`` (one element for float types)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]


def make_blocks(
    type_name: str, n_blocks: int, device: torch.device | str, generator: torch.Generator
) -> torch.Tensor:
    """uint8 [n_blocks, block bytes]: valid random blocks (elements, for float types) on
    ``device``, made with ``generator`` (which must live on that device)."""
    dev = torch.device(device)
    if type_name in _FLOATS:
        values = torch.randn(n_blocks, generator=generator, device=dev) * WEIGHT_STD
        return values.to(_FLOATS[type_name]).view(torch.uint8).view(n_blocks, _unit(type_name))
    recipe = _RECIPES.get(type_name)
    if recipe is None:
        raise ValueError(
            f"no synthetic data generator for GGML type {type_name} "
            f"(supported: {', '.join(sorted(supported_types()))})"
        )
    size = _unit(type_name)
    blocks = torch.randint(
        0, 256, (n_blocks, size), dtype=torch.uint8, generator=generator, device=dev
    )  # [n_blocks, size]
    u = torch.rand(n_blocks, generator=generator, device=dev)  # [n_blocks]
    d = ((u + 0.5) * recipe.d).to(torch.float16)
    off = recipe.fields[0]
    blocks[:, off : off + 2] = d.view(torch.uint8).view(n_blocks, 2)
    if len(recipe.fields) > 1:
        off = recipe.fields[1]
        m = (d.float() * recipe.min_ratio).to(torch.float16)
        blocks[:, off : off + 2] = m.view(torch.uint8).view(n_blocks, 2)
    return blocks


# ---------------------------------------------------------------------------------------------
# device side: synth_weight


_device_pools: dict[tuple[str, str], torch.Tensor] = {}


def _device_pool(type_name: str, device: torch.device) -> torch.Tensor:
    """The cached flat uint8 pool of ``type_name`` blocks on ``device``."""
    key = (str(device), type_name)
    pool = _device_pools.get(key)
    if pool is None:
        unit = _unit(type_name)
        n_blocks = max(1, DEVICE_POOL_BYTES.get(device.type, DEVICE_POOL_BYTES["cpu"]) // unit)
        gen = torch.Generator(device=device).manual_seed(
            _POOL_SEED + int(GGMLQuantizationType[type_name])
        )
        pool = _device_pools[key] = make_blocks(type_name, n_blocks, device, gen).view(-1)
    return pool


def release_pools() -> None:
    """Drop the cached per-type device pools (a few hundred MB of GPU memory after a load)."""
    _device_pools.clear()


def synth_weight(t: TensorInfo, device: torch.device | str, seed: int = 0) -> QuantWeight:
    """``t`` as a QuantWeight of valid random blocks made on ``device``, without host data.

    The bytes are a per-type random pool (made once per device and type) tiled from a
    block-aligned start that ``seed`` picks, so tensors differ and a 35 GB model takes a few
    device-to-device copies of bandwidth, not 35 GB of fresh randomness. ValueError if the CUDA
    kernels cannot read ``t``'s type or row width, or no generator exists for the type.
    """
    if not t.shape:
        raise ValueError(f"tensor {t.name!r} has no dimensions")
    rb = row_bytes(t.name, t.type_name, t.shape[0])  # validates the type and width
    rows = prod(t.shape[1:])
    total = rows * rb
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if t.type_name not in supported_types():
        raise ValueError(f"tensor {t.name!r}: no synthetic data generator for {t.type_name}")
    pool = _device_pool(t.type_name, dev)  # [P * unit]
    unit = _unit(t.type_name)
    n_units = pool.numel() // unit
    pos = int(np.random.default_rng(seed).integers(0, n_units)) * unit
    out = torch.empty(total, dtype=torch.uint8, device=dev)  # [rows * row_bytes]
    done = 0
    while done < total:
        n = min(total - done, pool.numel() - pos)
        out[done : done + n].copy_(pool[pos : pos + n])
        done += n
        pos = 0
    return QuantWeight(t.name, t.type_name, tuple(t.shape), out.view(rows, rb))


# ---------------------------------------------------------------------------------------------
# host side: SynthFile


def reader_value(value: Any, vtype: GGUFValueType | None) -> Any:
    """What ``GGUFFile.metadata`` holds for a key that ``GGUFWriter.add(key, value, vtype)`` wrote:
    plain scalars (float32-rounded floats), ``list[str]`` for string arrays and read-only numpy
    arrays of the element type for numeric arrays."""
    if isinstance(value, (list, tuple, np.ndarray)):
        etype = vtype if vtype is not None else _infer_element(value)
        if etype == GGUFValueType.STRING:
            return [str(v) for v in value]
        arr = np.array(value, dtype=_NP_DTYPE[etype])
        arr.flags.writeable = False
        return arr
    vtype = vtype if vtype is not None else _infer_scalar(value)
    if vtype == GGUFValueType.STRING:
        return str(value)
    if vtype == GGUFValueType.BOOL:
        return bool(value)
    return np.array(value, dtype=_NP_DTYPE[vtype]).item()


def _gguf_layout(type_name: str, shape: tuple[int, ...], raw: np.ndarray) -> np.ndarray:
    """Flat bytes ``raw`` in the dtype/shape gguf-py gives a tensor of that type and GGUF shape:
    F32/F16 elements in reversed shape, every other type uint8 [..., row bytes]."""
    np_shape = tuple(reversed(shape))
    if type_name == "F32":
        return raw.view(np.float32).reshape(np_shape)
    if type_name == "F16":
        return raw.view(np.float16).reshape(np_shape)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return raw.view(np.uint8).reshape(*np_shape[:-1], np_shape[-1] // block * size)


def _kind(name: str) -> str:
    """``blk.3.attn_norm.weight`` -> ``attn_norm``; ``blk.0.ssm_a`` -> ``ssm_a``."""
    name = re.sub(r"^blk\.\d+\.", "", name)
    return re.sub(r"\.(weight|bias)$", "", name)


_NORM = re.compile(r"(^|[._])norm($|[._])")


def _special_values(
    kind: str, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray | None:
    """float32 values in reversed ``shape`` for tensors that random weights would break, else
    None (then the tensor takes pool values like any weight)."""
    n = prod(shape)
    if _NORM.search(kind):  # RMSNorm gammas, stored with any "1 +" folded in: near 1
        v = 1.0 + WEIGHT_STD * rng.standard_normal(n)
    elif kind == "ssm_a":  # -exp(A_log), A ~ U[1, 16] as the HF init
        v = -rng.uniform(1.0, 16.0, n)
    elif kind == "ssm_dt":  # dt bias: softplus^-1 of dt ~ logU[1e-3, 1e-1] (HF init)
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n))
        v = dt + np.log(-np.expm1(-dt))
    elif kind in ("ssm_conv1d", "ple_conv1d"):  # depthwise taps: U(+-1/sqrt(K)), K = shape[0]
        bound = 1.0 / math.sqrt(shape[0])
        v = rng.uniform(-bound, bound, n)
    else:
        return None
    return v.astype(np.float32).reshape(tuple(reversed(shape)))


def _encode_floats(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values -> flat uint8 bytes of ``type_name`` (F32, F16 or BF16)."""
    if type_name == "F32":
        return values.astype("<f4").reshape(-1).view(np.uint8)
    if type_name == "F16":
        return values.astype("<f2").reshape(-1).view(np.uint8)
    if type_name == "BF16":  # round to nearest even on the dropped 16 bits
        raw = values.astype("<f4").reshape(-1).view(np.uint32).astype(np.uint64)
        rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
        return rounded.astype("<u2").view(np.uint8)
    raise ValueError(f"special values for type {type_name} are not supported")


class _TiledMapping:
    """A read-only address range that repeats one memfd pool: numpy's ``__array_interface__``
    over it gives a [rows, row bytes] array whose ``base`` is this object (so the mapping lives as
    long as any view). ``_mmap`` is None so ``ple.advise_random`` stops here."""

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
    return np.asarray(_TiledMapping(pool, rows * rb, (rows, rb)))


def _ple_table_data(type_name: str, shape: tuple[int, ...], gen: torch.Generator) -> np.ndarray:
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


def _device_made(name: str, type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``synth_weight`` can make this tensor (a type and row width the CUDA kernels read);
    other tensors keep host data whatever their size."""
    if type_name not in supported_types():
        return False
    try:
        row_bytes(name, type_name, shape[0])
    except ValueError:
        return False
    return True


class SynthFile(GGUFFile):
    """A synthetic model of ``spec`` in memory: ``GGUFFile``'s interface, no file.

    ``metadata`` and the tensor table are what ``GGUFFile`` reads from the file ``write_synth``
    writes for ``spec``; ``TensorInfo.offset`` is the data-section-relative offset that file would
    have. ``data`` is host numpy data for small tensors and the PLE table, ``None`` for the
    matrices that ``synth_weight`` makes on the device.
    """

    def __init__(self, spec: ShapeSpec, *, seed: int = 0, label: str | None = None) -> None:
        self.spec = spec
        self.path = Path(
            label
            or f"<synthetic {spec.arch} {spec.name}, {spec.n_layer} layers, "
            f"{spec.n_expert} experts>"
        )
        self.metadata = {"general.architecture": spec.arch}
        for key, (value, vtype) in metadata(spec).items():
            self.metadata[key] = reader_value(value, vtype)
        plan = tensor_plan(spec)
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        pools = self._host_pools(plan, gen)
        self.tensors = {}
        offset = 0
        for p in plan:
            type_name = p.ggml_type.name
            n_elements = prod(p.shape)
            n_bytes = tensor_nbytes(p.shape, p.ggml_type)
            data: np.ndarray | None
            kind = _kind(p.name)
            if kind == "per_layer_token_embd":
                data = _ple_table_data(type_name, p.shape, gen)
            elif n_elements > HOST_MAX_ELEMENTS and _device_made(p.name, type_name, p.shape):
                data = None
            else:
                special = _special_values(kind, p.shape, rng)
                if special is not None:
                    raw = _encode_floats(special, type_name)
                else:
                    pool = pools[type_name]
                    unit = _unit(type_name)
                    start = int(rng.integers(0, (pool.size - n_bytes) // unit + 1)) * unit
                    raw = pool[start : start + n_bytes]
                data = _gguf_layout(type_name, p.shape, raw)
                data.flags.writeable = False
            self.tensors[p.name] = TensorInfo(
                name=p.name,
                type_name=type_name,
                type_id=int(p.ggml_type),
                shape=tuple(p.shape),
                n_elements=n_elements,
                n_bytes=n_bytes,
                offset=offset,
                data=data,  # type: ignore[arg-type]  # None: made on the device
            )
            offset += -(-n_bytes // 32) * 32  # the writer's 32-byte alignment

    @staticmethod
    def _host_pools(plan: list[Any], gen: torch.Generator) -> dict[str, np.ndarray]:
        """Per type, a flat uint8 pool of random blocks at least twice the largest small tensor
        of that type, so every small tensor is a view of it."""
        need: dict[str, int] = {}
        for p in plan:
            if prod(p.shape) <= HOST_MAX_ELEMENTS:
                name = p.ggml_type.name
                need[name] = max(need.get(name, 0), tensor_nbytes(p.shape, p.ggml_type))
        pools = {}
        for name, largest in need.items():
            unit = _unit(name)
            n_blocks = max(HOST_POOL_BYTES, 2 * largest) // unit
            pool = make_blocks(name, n_blocks, "cpu", gen).numpy().reshape(-1)
            pool.flags.writeable = False
            pools[name] = pool
        return pools

    @classmethod
    def from_shape(
        cls,
        name: str,
        *,
        layers: int | None = None,
        experts: int | None = None,
        ple_rows: int | None = None,
        seed: int = 0,
    ) -> SynthFile:
        """The named shape of ``SHAPES`` (``mgserve synth --shape``), optionally shrunk."""
        if name not in SHAPES:
            raise ValueError(f"unknown synthetic shape {name!r} (known: {', '.join(SHAPES)})")
        spec = SHAPES[name].shrink(experts=experts, ple_rows=ple_rows, layers=layers)
        label = f"<synthetic {name}, {spec.n_layer} layers, {spec.n_expert} experts>"
        return cls(spec, seed=seed, label=label)
