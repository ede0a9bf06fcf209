"""``SynthFile``: a synthetic model of a ``ShapeSpec`` in memory with ``GGUFFile``'s interface.

Its metadata and tensor table are what ``GGUFFile`` reads from the file ``write_synth`` writes for
the same spec; small tensors carry host data (random blocks, or the values of values.py), the PLE
table comes from ple.py, and the large matrices have no data: ``Loader.mat`` makes them on the
device with ``synth_weight``.
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from mgserve.core.gguf.reader import GGUFFile, TensorInfo
from mgserve.core.gguf.writer import _NP_DTYPE, _infer_element, _infer_scalar, tensor_nbytes
from mgserve.core.synth.mixes import DEFAULT_MIX, mix_of
from mgserve.core.synth.shapes import SHAPES, ShapeSpec, metadata
from mgserve.core.synth.tensors import tensor_plan
from mgserve.cuda.synth_device.blocks import block_bytes, make_blocks
from mgserve.cuda.synth_device.device import device_made
from mgserve.cuda.synth_device.ple import ple_table_data
from mgserve.cuda.synth_device.values import encode_floats, special_values, tensor_kind

HOST_MAX_ELEMENTS = 1 << 20  # tensors up to this many values get host data; larger: data None
HOST_POOL_BYTES = 8 << 20  # per-type host pool the small tensors are views of


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


class SynthFile(GGUFFile):
    """A synthetic model of ``spec`` in quant mix ``mix`` in memory: ``GGUFFile``'s interface, no
    file.

    ``metadata`` and the tensor table are what ``GGUFFile`` reads from the file ``write_synth``
    writes for ``spec`` and ``mix``; ``TensorInfo.offset`` is the data-section-relative offset
    that file would have. ``data`` is host numpy data for small tensors and the PLE table,
    ``None`` for the matrices that ``synth_weight`` makes on the device.
    """

    def __init__(
        self,
        spec: ShapeSpec,
        *,
        seed: int = 0,
        label: str | None = None,
        mix: str = DEFAULT_MIX,
    ) -> None:
        self.spec = spec
        self.path = Path(
            label
            or f"<synthetic {spec.arch} {spec.name}, {spec.n_layer} layers, "
            f"{spec.n_expert} experts>"
        )
        self.metadata = {"general.architecture": spec.arch}
        for key, (value, vtype) in metadata(spec, mix_of(mix).file_type).items():
            self.metadata[key] = reader_value(value, vtype)
        plan = tensor_plan(spec, mix)
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
            kind = tensor_kind(p.name)
            if kind == "per_layer_token_embd":
                data = ple_table_data(type_name, p.shape, gen)
            elif n_elements > HOST_MAX_ELEMENTS and device_made(p.name, type_name, p.shape):
                data = None
            else:
                special = special_values(kind, p.shape, rng)
                if special is not None:
                    raw = encode_floats(special, type_name)
                else:
                    pool = pools[type_name]
                    unit = block_bytes(type_name)
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
            unit = block_bytes(name)
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
        mix: str = DEFAULT_MIX,
    ) -> SynthFile:
        """The named shape of ``SHAPES`` (``mgserve synth --shape``) in quant mix ``mix``,
        optionally shrunk."""
        if name not in SHAPES:
            raise ValueError(f"unknown synthetic shape {name!r} (known: {', '.join(SHAPES)})")
        spec = SHAPES[name].shrink(experts=experts, ple_rows=ple_rows, layers=layers)
        label = f"<synthetic {name} {mix}, {spec.n_layer} layers, {spec.n_expert} experts>"
        return cls(spec, seed=seed, label=label, mix=mix)
