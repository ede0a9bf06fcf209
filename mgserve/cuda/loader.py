"""GGUF tensors -> device weights for the device models: matrices stay in their quantized block
layout (``QuantWeight``, read by the matvec / matmul kernels), vectors and small elementwise weights
(norm gammas, biases, conv taps) become float32 tensors.

Shapes are checked in GGUF order (ne0 first) like the reference loaders, trailing 1s ignored, so
a file that the reference path rejects is rejected here with the same kind of message.
"""

from __future__ import annotations

import torch

from mgserve.core.gguf import GGUFError, GGUFFile
from mgserve.core.reference.dequant import dequantize
from mgserve.cuda.weights import QuantWeight, upload


def _strip(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


class Loader:
    """Reads one GGUF file onto one device."""

    def __init__(self, g: GGUFFile, device: torch.device) -> None:
        self.g = g
        self.device = device
        self.nbytes = 0  # bytes uploaded so far

    def has(self, name: str) -> bool:
        return name in self.g.tensors

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        t = self.g.tensor(name)
        if _strip(t.shape) != _strip(shape):
            raise GGUFError(
                f"{self.g.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
            )

    def mat(self, name: str, shape: tuple[int, ...]) -> QuantWeight:
        """A matrix (or a stack of expert matrices) in its file layout; GGUF shape ``shape``."""
        self._check(name, shape)
        t = self.g.tensor(name)
        try:
            if t.data is None:  # a synthetic model's matrix: random blocks made on the device
                from mgserve.cuda.synth_device import synth_weight

                w = synth_weight(t, self.device, seed=len(name) + self.nbytes)
            else:
                w = upload(t, self.device)
        except ValueError as e:  # unsupported type or width: name the file too
            raise GGUFError(f"{self.g.path}: {e}") from None
        self.nbytes += w.nbytes
        return w

    def vec(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """float32 in torch order ([..., ne1, ne0]), trailing 1s dropped."""
        self._check(name, shape)
        t = dequantize(self.g, self.g.tensor(name)).reshape(tuple(reversed(_strip(shape))))
        out = t.to(self.device)
        self.nbytes += out.nbytes
        return out


def select_rows(w: QuantWeight, idx: torch.Tensor) -> QuantWeight:
    """A 2-D weight made of rows ``idx`` of ``w`` (output features reordered or picked): row i of
    the result is row idx[i]. Quantized rows are independent, so this is a byte copy."""
    if idx.dim() != 1 or (idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < w.rows):
        raise ValueError(f"{w.name}: row indices out of range 0..{w.rows - 1}")
    data = w.data[idx.to(w.data.device)].contiguous()
    return QuantWeight(w.name, w.type_name, (w.k, idx.numel()), data)


def rows_of(w: QuantWeight, row0: int, n: int) -> QuantWeight:
    """Rows [row0, row0 + n) of a 2-D weight as a weight of its own (a view, no copy)."""
    if not 0 <= row0 < row0 + n <= w.rows:
        raise ValueError(f"{w.name}: rows {row0}..{row0 + n} out of {w.rows}")
    return QuantWeight(w.name, w.type_name, (w.k, n), w.data[row0 : row0 + n])
