"""GGUF file -> metadata and a tensor table, memory-mapped through ``gguf.GGUFReader``.

Every error names the file and the key or tensor at fault, so a user with a broken download or an
unsupported model knows what to do. ``ModelSpec`` (per architecture hyperparameters) lives in
``mgserve/core/spec.py`` and is built from ``GGUFFile.metadata``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


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


class GGUFFile:
    """An opened GGUF file: metadata (plain Python values) and a table of memory-mapped tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # gguf-py raises ValueError/IndexError/... on garbage
            raise GGUFError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self.metadata: dict[str, Any] = {}
        for key, fld in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = fld.contents()
            except Exception as e:
                raise GGUFError(f"{self.path}: metadata key {key!r} cannot be decoded: {e}") from e
        self.tensors: dict[str, TensorInfo] = {}
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            info = TensorInfo(
                name=t.name,
                type_name=t.tensor_type.name,
                type_id=int(t.tensor_type),
                shape=tuple(int(x) for x in t.shape),
                n_elements=int(t.n_elements),
                n_bytes=int(t.n_bytes),
                offset=int(t.data_offset),
                data=t.data,
            )
            if info.offset + info.n_bytes > size:
                raise GGUFError(
                    f"{self.path}: tensor {t.name!r} ends at byte {info.offset + info.n_bytes} "
                    f"but the file has {size} bytes (truncated download?)"
                )
            self.tensors[t.name] = info

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
        return self.tensors[name]

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())
