"""GGUF tensors -> device weights for the device models: matrices stay in their quantized block
layout (``QuantWeight``, read by the matvec / matmul kernels), vectors and small elementwise weights
(norm gammas, biases, conv taps) become float32 tensors.

Shapes are checked by ``core.gguf.layout`` (llama.cpp's rule), the same check as the reference
loaders', so both take the same files and refuse a wrong one with the same message.
"""

from __future__ import annotations

import zlib

import torch

from mgserve.core.gguf.layout import check_tensor, torch_shape
from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.reference.dequant import dequantize
from mgserve.cuda.weights import QuantWeight, upload


class Loader:
    """Reads one GGUF file onto one device."""

    def __init__(self, g: GGUFFile, device: torch.device) -> None:
        self.g = g
        self.device = device
        self.nbytes = 0  # bytes uploaded so far

    def has(self, name: str) -> bool:
        return name in self.g.tensors

    def opt_vec(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """``vec`` if the file has ``name`` (llama.cpp's ``TENSOR_NOT_REQUIRED``), else None."""
        return self.vec(name, shape) if self.has(name) else None

    def qkv(
        self, prefix: str, d: int, nq: int, nk: int, nv: int
    ) -> tuple[QuantWeight, QuantWeight, QuantWeight, list[torch.Tensor | None]]:
        """Attention q/k/v projections of ``prefix`` (``blk.N.``) from three tensors or a fused
        ``attn_qkv`` (then row views of it, no copy), and their biases ([bq, bk, bv], None where
        the file has none)."""
        fused = prefix + "attn_qkv."
        if self.has(fused + "weight"):
            w = self.mat(fused + "weight", (d, nq + nk + nv))
            wq, wk, wv = rows_of(w, 0, nq), rows_of(w, nq, nk), rows_of(w, nq + nk, nv)
            if self.has(fused + "bias"):
                b = self.vec(fused + "bias", (nq + nk + nv,))
                return wq, wk, wv, list(b.split((nq, nk, nv)))
        else:
            wq = self.mat(prefix + "attn_q.weight", (d, nq))
            wk = self.mat(prefix + "attn_k.weight", (d, nk))
            wv = self.mat(prefix + "attn_v.weight", (d, nv))
        biases = [
            self.opt_vec(prefix + f"attn_{x}.bias", (n,))
            for x, n in zip("qkv", (nq, nk, nv), strict=True)
        ]
        return wq, wk, wv, biases

    def mat(self, name: str, shape: tuple[int, ...]) -> QuantWeight:
        """A matrix (or a stack of expert matrices) in its file layout; GGUF shape ``shape``."""
        t = check_tensor(self.g, name, shape)
        try:
            if t.data is None:  # a synthetic model's matrix: random blocks made on the device
                from mgserve.cuda.synth_device import synth_weight

                # seeded by the name alone: a stage that loads only its layers (a process of a
                # pipeline) gets the bytes the whole model's load gives that tensor
                w = synth_weight(t, self.device, seed=zlib.crc32(name.encode()))
            else:
                w = upload(t, self.device)
        except ValueError as e:  # unsupported type or width: name the file too
            raise GGUFError(f"{self.g.path}: {e}") from None
        self.nbytes += w.nbytes
        return w

    def vec(self, name: str, shape: tuple[int, ...], reshape_ok: bool = False) -> torch.Tensor:
        """float32 in torch order ([..., ne1, ne0]), trailing 1s dropped; ``reshape_ok``: any
        shape of as many elements reads as ``shape`` (llama.cpp's ``TENSOR_ALLOW_RESHAPE``)."""
        t = dequantize(self.g, check_tensor(self.g, name, shape, reshape_ok))
        t = t.reshape(torch_shape(shape))
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


def fuse_rows(*ws: QuantWeight) -> list[QuantWeight]:
    """Projections of one input as one weight, their rows stacked in order (one matvec instead of
    several), when they share a format and width; else the weights unchanged."""
    first = ws[0]
    if any(w.type_name != first.type_name or w.k != first.k for w in ws[1:]):
        return list(ws)
    data = torch.cat([w.data for w in ws])  # [sum of rows, row_bytes]
    name = "+".join(w.name for w in ws)
    return [QuantWeight(name, first.type_name, (first.k, data.shape[0]), data)]
