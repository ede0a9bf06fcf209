"""A streaming GGUF writer: header, typed metadata, tensor infos, then tensor data tensor by tensor.

Layout (GGUF v3, little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset)
    zero padding to `alignment` | tensor data, each tensor starting at a multiple of `alignment`

A string is a u64 byte length and UTF-8 bytes; an array is a u32 element type, a u64 count and the
elements. Offsets are relative to the start of the data section.

Usage: ``add`` metadata, ``add_tensor_info`` for every tensor, ``write_header``, then
``write_tensor_data`` (or ``write_tensor_chunks``) once per tensor in the declared order, ``close``.
All tensor infos precede the data in the file, so they must all be known before any data is
written; the data itself streams, so a multi-GB file never sits in memory.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

_SCALAR_FMT: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NP_DTYPE: dict[GGUFValueType, str] = {t: f[1:] for t, f in _SCALAR_FMT.items()}
_FROM_NP: dict[str, GGUFValueType] = {
    "uint8": GGUFValueType.UINT8,
    "int8": GGUFValueType.INT8,
    "uint16": GGUFValueType.UINT16,
    "int16": GGUFValueType.INT16,
    "uint32": GGUFValueType.UINT32,
    "int32": GGUFValueType.INT32,
    "uint64": GGUFValueType.UINT64,
    "int64": GGUFValueType.INT64,
    "float32": GGUFValueType.FLOAT32,
    "float64": GGUFValueType.FLOAT64,
    "bool": GGUFValueType.BOOL,
}


def tensor_nbytes(shape: Sequence[int], ggml_type: GGMLQuantizationType) -> int:
    """Bytes of a ``ggml_type`` tensor of ``shape`` (GGUF order: ``shape[0]`` is contiguous)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if not shape or any(int(d) <= 0 for d in shape):
        raise ValueError(f"tensor shape {tuple(shape)} must have positive dimensions")
    if shape[0] % block != 0:
        raise ValueError(
            f"row width {shape[0]} is not a multiple of the {ggml_type.name} block size {block}"
        )
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) // block * type_size


def _infer_int(values: Sequence[int], scalar: bool) -> GGUFValueType:
    # llama.cpp reads almost every integer key as uint32 and checks the type strictly, so a
    # non-negative scalar is UINT32; integer arrays are accepted as INT32 or UINT32 (as gguf-py).
    lo, hi = min(values), max(values)
    if scalar and lo >= 0 and hi < 2**32:
        return GGUFValueType.UINT32
    if lo >= -(2**31) and hi < 2**31:
        return GGUFValueType.INT32
    if lo >= 0 and hi >= 2**63:
        return GGUFValueType.UINT64
    return GGUFValueType.INT64


def _infer_scalar(value: Any) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        return _infer_int([int(value)], scalar=True)
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise ValueError(f"cannot infer a GGUF type for {type(value).__name__} value {value!r}")


def _infer_element(values: Sequence[Any] | np.ndarray) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        if values.dtype.name not in _FROM_NP:
            raise ValueError(f"no GGUF array type for numpy dtype {values.dtype}")
        return _FROM_NP[values.dtype.name]
    if len(values) == 0:
        raise ValueError("cannot infer the element type of an empty array; pass type=")
    if all(isinstance(v, str) for v in values):
        return GGUFValueType.STRING
    if all(isinstance(v, (bool, np.bool_)) for v in values):
        return GGUFValueType.BOOL
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return _infer_int([int(v) for v in values], scalar=False)
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        return GGUFValueType.FLOAT32
    raise ValueError("array elements must all be str, bool, int or float")


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _encode(value: Any, vtype: GGUFValueType) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(str(value))
    fmt = _SCALAR_FMT.get(vtype)
    if fmt is None:
        raise ValueError(f"unsupported scalar GGUF type {vtype.name}")
    return struct.pack(fmt, value)


def _encode_array(values: Sequence[Any] | np.ndarray, etype: GGUFValueType) -> bytes:
    head = struct.pack("<IQ", int(etype), len(values))
    if etype == GGUFValueType.STRING:
        return head + b"".join(_string(str(v)) for v in values)
    if etype == GGUFValueType.ARRAY or etype not in _NP_DTYPE:
        raise ValueError(f"unsupported GGUF array element type {etype.name}")
    # one numpy conversion instead of a struct.pack per element: a 248k-entry token_type is instant
    is_float = etype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "f" and not is_float:
            raise ValueError(f"float values cannot be stored as {etype.name}")
        return head + values.astype(_NP_DTYPE[etype], copy=False).tobytes()
    if not is_float and any(isinstance(v, float) for v in values):
        raise ValueError(f"float values cannot be stored as {etype.name}")
    try:
        arr = np.array(values, dtype=_NP_DTYPE[etype])
    except OverflowError as e:
        raise ValueError(f"array values do not fit {etype.name}: {e}") from e
    return head + arr.tobytes()


class GGUFWriter:
    """Writes one GGUF file; see the module docstring for the call order."""

    def __init__(
        self, path: str | os.PathLike[str], arch: str | None, *, alignment: int = DEFAULT_ALIGNMENT
    ) -> None:
        if alignment <= 0 or alignment % 8 != 0:
            raise ValueError(f"alignment must be a positive multiple of 8, got {alignment}")
        self.path = os.fspath(path)
        self.alignment = alignment
        self._kv: dict[str, bytes] = {}  # key -> encoded (u32 type + value)
        self._tensors: dict[str, tuple[tuple[int, ...], GGMLQuantizationType, int]] = {}
        self._order: list[str] = []
        self._next = 0  # index into _order of the next tensor whose data is due
        self._file: BinaryIO | None = None
        if arch is not None:
            self.add("general.architecture", arch)
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", alignment, GGUFValueType.UINT32)

    def add(self, key: str, value: Any, type: GGUFValueType | None = None) -> None:
        """Add one metadata key. For a list/tuple/ndarray value, ``type`` is the element type."""
        if self._file is not None:
            raise ValueError(f"metadata key {key!r} added after the header was written")
        if key in self._kv:
            raise ValueError(f"metadata key {key!r} added twice")
        if isinstance(value, (list, tuple, np.ndarray)):
            etype = type if type is not None else _infer_element(value)
            self._kv[key] = struct.pack("<I", int(GGUFValueType.ARRAY)) + _encode_array(
                value, etype
            )
            return
        vtype = type if type is not None else _infer_scalar(value)
        try:
            self._kv[key] = struct.pack("<I", int(vtype)) + _encode(value, vtype)
        except struct.error as e:
            raise ValueError(f"metadata key {key!r}: {value!r} does not fit {vtype.name}") from e

    def add_tensor_info(
        self, name: str, shape: Sequence[int], ggml_type: GGMLQuantizationType | int
    ) -> None:
        """Declare a tensor; ``shape`` is in GGUF order (``shape[0]`` is the contiguous row)."""
        if self._file is not None:
            raise ValueError(f"tensor {name!r} declared after the header was written")
        if name in self._tensors:
            raise ValueError(f"tensor {name!r} declared twice")
        if len(name.encode("utf-8")) >= 64:
            raise ValueError(f"tensor name {name!r} is longer than GGML's 63-byte limit")
        gtype = GGMLQuantizationType(int(ggml_type))
        dims = tuple(int(d) for d in shape)
        try:
            nbytes = tensor_nbytes(dims, gtype)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from e
        self._tensors[name] = (dims, gtype, nbytes)
        self._order.append(name)

    def write_header(self) -> None:
        """Write header, metadata and tensor infos, padded so the data section starts aligned."""
        if self._file is not None:
            raise ValueError("header already written")
        parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self._order), len(self._kv))]
        parts += [_string(k) + v for k, v in self._kv.items()]
        offset = 0
        for name in self._order:
            dims, gtype, nbytes = self._tensors[name]
            parts.append(_string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims))
            parts.append(struct.pack("<IQ", int(gtype), offset))
            offset += self._padded(nbytes)
        head = b"".join(parts)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(head + bytes(self._padded(len(head)) - len(head)))

    def write_tensor_data(self, name: str, data: bytes | memoryview | np.ndarray) -> None:
        """Write one tensor's raw bytes (already in its GGML layout)."""
        self.write_tensor_chunks(name, [data])

    def write_tensor_chunks(
        self, name: str, chunks: Iterable[bytes | memoryview | np.ndarray]
    ) -> None:
        """Write one tensor's raw bytes as a sequence of pieces; the total size is checked."""
        if self._file is None:
            raise ValueError(f"tensor {name!r} data written before write_header()")
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r}: all declared tensors are already written")
        expected = self._order[self._next]
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order; {expected!r} is next")
        nbytes = self._tensors[name][2]
        written = 0
        for chunk in chunks:
            buf = np.ascontiguousarray(chunk).data if isinstance(chunk, np.ndarray) else chunk
            buf = memoryview(buf)
            written += buf.nbytes
            if written > nbytes:
                raise ValueError(f"tensor {name!r}: more than the expected {nbytes} bytes of data")
            self._file.write(buf)
        if written != nbytes:
            raise ValueError(f"tensor {name!r}: got {written} bytes of data, expected {nbytes}")
        self._file.write(bytes(self._padded(nbytes) - nbytes))
        self._next += 1

    def close(self) -> None:
        """Close the file; raises if a declared tensor has no data (the file is then incomplete)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self._next < len(self._order):
            raise ValueError(
                f"{self.path}: closed before the data of tensor {self._order[self._next]!r} "
                f"({len(self._order) - self._next} of {len(self._order)} tensors missing)"
            )

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and self._file is not None:
            self._file.close()  # an error is already on its way; don't mask it with ours
            self._file = None
            return
        self.close()

    def _padded(self, n: int) -> int:
        return (n + self.alignment - 1) // self.alignment * self.alignment
