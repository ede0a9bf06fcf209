"""Slot files: a saved slot on disk (``--slot-save-path``) and what makes one loadable here.

A file is the magic ``MGSLOT``, the header's length (8 bytes, little-endian), the header (JSON),
then each tensor's bytes in the header's order. The header holds the format version, the
identity of what saved it (model fingerprint, architecture, the runner's tensor layout, which
names a pipeline's split of the layers: pipeline/slots_dist.py, the K/V cache types), the
context size, the slot's tokens, its checkpoint positions and the tensor table (name, dtype,
shape). A file is refused, with the reason, when any of that does not match this server (a
context too small for its tokens included). It is written beside its final name and renamed,
so a crash never leaves half a file under that name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mgserve.core.engine.slot_actions import SavedSlot
from mgserve.core.gguf.reader import GGUFFile

MAGIC = b"MGSLOT"
VERSION = 2
_DTYPES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i8": torch.int8,
    "i32": torch.int32,
    "i64": torch.int64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_SAMPLE = 64  # bytes of each tensor the model fingerprint reads


class SlotIdentity(NamedTuple):
    """What a saved slot can only be loaded back into."""

    fingerprint: str  # model_fingerprint of the GGUF file
    arch: str
    runner: str  # Runner.slot_format
    type_k: str
    type_v: str


def model_fingerprint(g: GGUFFile) -> str:
    """What tells one model file from another without reading its weights: a hash of the file's
    size, its header (metadata, tensor table) and the first bytes of every tensor."""
    tensors = sorted(g, key=lambda t: t.offset)
    size = g.path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(g.path, "rb") as f:
        h.update(f.read(tensors[0].offset if tensors else size))
        for t in tensors:
            f.seek(t.offset)
            h.update(f.read(min(_SAMPLE, t.n_bytes)))
    return h.hexdigest()[:32]


def write(path: Path, identity: SlotIdentity, n_ctx: int, saved: SavedSlot) -> int:
    """Write ``saved`` to ``path``; the file's size in bytes."""
    tensors = {k: v.contiguous() for k, v in saved.tensors.items()}
    header = {
        "version": VERSION,
        "identity": identity._asdict(),
        "n_ctx": n_ctx,
        "tokens": list(saved.tokens),
        "checkpoints": list(saved.checkpoints),
        "cuts": list(saved.cuts),
        "tensors": [[k, _NAMES[t.dtype], list(t.shape)] for k, t in tensors.items()],
    }
    head = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(head).to_bytes(8, "little") + head)
            for t in tensors.values():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read(path: Path, identity: SlotIdentity, n_ctx: int) -> tuple[SavedSlot, int]:
    """The saved slot in ``path`` and the bytes read; ValueError saying why it cannot be loaded
    here."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path.name} is not a slot file")
        header = _header(f.read(int.from_bytes(f.read(8), "little")), path.name)
        _check(header, identity, n_ctx, path.name)
        table = [(n, _DTYPES[d], s) for n, d, s in header["tensors"]]
        size = sum(d.itemsize * math.prod(s) for _, d, s in table)
        if size != os.fstat(f.fileno()).st_size - f.tell():
            raise ValueError(f"{path.name} is not as long as its tensor table says")
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape in table:
            t = torch.empty(shape, dtype=dtype)
            raw = t.reshape(-1).view(torch.uint8).numpy()
            if f.readinto(raw.data) != raw.nbytes:
                raise ValueError(f"{path.name} was cut short (in {name!r})")
            tensors[name] = t
        n_read = f.tell()
    saved = SavedSlot(
        tuple(header["tokens"]), tuple(header["checkpoints"]), tensors, tuple(header["cuts"])
    )
    return saved, n_read


def _header(raw: bytes, name: str) -> dict[str, Any]:
    try:
        h = json.loads(raw)
        ok = (
            isinstance(h["version"], int)
            and isinstance(h["identity"], dict)
            and all(
                isinstance(t, int) and t >= 0 for t in h["tokens"] + h["checkpoints"] + h["cuts"]
            )
            and all(
                isinstance(n, str)
                and d in _DTYPES
                and all(isinstance(x, int) and x >= 0 for x in s)
                for n, d, s in h["tensors"]
            )
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{name} has a malformed header")
    return h  # type: ignore[no-any-return]


def _check(header: dict[str, Any], identity: SlotIdentity, n_ctx: int, name: str) -> None:
    if header["version"] != VERSION:
        raise ValueError(f"{name} is slot file version {header['version']}, this is {VERSION}")
    saved = header["identity"]
    what = {
        "fingerprint": "another model file",
        "arch": "another architecture",
        "runner": "another runner (device) or pipeline split",
        "type_k": "another K cache type",
        "type_v": "another V cache type",
    }
    for field, value in identity._asdict().items():
        if saved.get(field) != value:
            raise ValueError(
                f"{name} was saved from {what[field]} ({field} {saved.get(field)!r}, "
                f"this server: {value!r})"
            )
    if len(header["tokens"]) > n_ctx:
        raise ValueError(
            f"{name} holds {len(header['tokens'])} tokens, more than a slot's context here "
            f"({n_ctx}, --ctx-size)"
        )
    if any(p > len(header["tokens"]) for p in header["checkpoints"]):
        raise ValueError(f"{name} has a checkpoint past its tokens")
