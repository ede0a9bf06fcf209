"""GGUF file -> metadata and a tensor table, memory-mapped through ``gguf.GGUFReader``.

Every error names the file and the key or tensor at fault, so a user with a broken download or an
unsupported model knows what to do. ``ModelSpec`` (per architecture hyperparameters) lives in
``mgserve/core/gguf/hparams.py`` and is built from ``GGUFFile.metadata``.

Metadata values: scalars are plain Python values, string arrays are ``list[str]`` and numeric arrays
are read-only numpy arrays (they index, ``len()`` and iterate like lists). gguf-py's reader walks
arrays one element at a time, building two numpy views per string: ~8 s for a 262144-token
vocabulary. ``_FastReader`` overrides just that step for flat arrays of scalars or strings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from mgserve import progress


class GGUFError(ValueError):
    """A GGUF file that mgserve cannot use; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGML type name: "Q4_K", "F32", ...
    type_id: int  # GGML type id (gguf.GGMLQuantizationType value)
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous (row) dimension
    n_elements: int
    n_bytes: int
    offset: int  # absolute byte offset of the data in the file
    data: np.ndarray  # raw memory-mapped bytes/elements as gguf-py exposes them (no copy)


class _Truncated(ValueError):
    """A tensor's data runs past the end of the file (the reader does not know the path)."""


class _FastReader(GGUFReader):
    """``GGUFReader`` whose flat arrays are parsed in one go instead of one part per element.

    A numeric array becomes one numpy view (``parts[-1]``); a string array becomes one object array
    of decoded ``str`` (``parts[-1]``). ``ReaderField.contents()`` is not meant for these fields:
    read them through ``GGUFFile.metadata``. Nested arrays and big-endian files take gguf-py's own
    path.
    """

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[Any]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(int(raw_itype[0]))
        count = int(alen[0])
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            if len(values) != count:
                raise ValueError(f"array of {count} {itype.name} runs past the end of the file")
            size = 12 + int(values.nbytes)
            return size, [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]
        if itype == GGUFValueType.STRING:
            strings, end = _read_strings(memoryview(self.data.data), offs, count)
            size = end - orig_offs
            return size, [raw_itype, alen, strings], [2], [GGUFValueType.ARRAY, itype]
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        # gguf-py would fail on a short file with a bare reshape error; name the tensor instead.
        size = len(self.data)
        for f in fields:
            n_elems = int(np.prod([int(x) for x in f.parts[3]]))
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(f.parts[4][0]))]
            end = start_offs + int(f.parts[5][0]) + n_elems * type_size // block
            if end > size:
                name = str(bytes(f.parts[1]), "utf-8")
                raise _Truncated(
                    f"tensor {name!r} ends at byte {end} but the file has {size} bytes "
                    "(truncated download?)"
                )
        super()._build_tensors(start_offs, fields)


def _read_strings(buf: memoryview, offs: int, count: int) -> tuple[np.ndarray, int]:
    """``count`` GGUF strings (u64 length + UTF-8 bytes) from ``offs``; returns them and the end."""
    out = np.empty(count, dtype=object)
    size = len(buf)
    for i in range(count):
        n = int.from_bytes(buf[offs : offs + 8], "little")
        end = offs + 8 + n
        if end > size:
            raise ValueError(f"string {i} of {count} runs past the end of the file")
        out[i] = str(buf[offs + 8 : end], "utf-8")
        offs = end
    return out, offs


def _field_value(fld: Any) -> Any:
    types = fld.types
    if types and types[0] == GGUFValueType.ARRAY and len(types) == 2 and len(fld.data) == 1:
        values = fld.parts[fld.data[0]]
        if types[1] == GGUFValueType.STRING:
            return values.tolist()
        values = np.asarray(values)
        values.flags.writeable = False
        return values
    return fld.contents()


class GGUFFile:
    """An opened GGUF file: metadata (plain Python values) and a table of memory-mapped tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        try:
            self._reader = _FastReader(self.path, "r")
        except _Truncated as e:
            raise GGUFError(f"{self.path}: {e}") from e
        except Exception as e:  # gguf-py raises ValueError/IndexError/... on garbage
            raise GGUFError(
                f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})"
            ) from e
        self.metadata: dict[str, Any] = {}
        for key, fld in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = _field_value(fld)
            except Exception as e:
                raise GGUFError(f"{self.path}: metadata key {key!r} cannot be decoded: {e}") from e
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:  # _FastReader checked that each one fits in the file
            self.tensors[t.name] = TensorInfo(
                name=t.name,
                type_name=t.tensor_type.name,
                type_id=int(t.tensor_type),
                shape=tuple(int(x) for x in t.shape),
                n_elements=int(t.n_elements),
                n_bytes=int(t.n_bytes),
                offset=int(t.data_offset),
                data=t.data,
            )

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: required tensor {name!r} is missing")
        progress.tensor_read(name, len(self.tensors))  # the loaders ask for each tensor here
        return self.tensors[name]

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())
