"""GGUF tensors -> float32 torch weights for the reference models, in every form llama.cpp loads.

Shapes are checked by ``core.gguf.layout.check_tensor`` (llama.cpp's rule). What a loader may find:

- attention q/k/v as three tensors or fused ``attn_qkv`` ([q | k | v] rows; llama.cpp's
  ``create_tensor_qkv``, written by ``convert_hf_to_gguf.py --fuse-qkv``), biases fused
  (``attn_qkv.bias``), split, or absent: every architecture may carry them, none must;
- the output projection, or none (tied to ``token_embd``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mgserve.core.gguf.layout import check_tensor, torch_shape
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.reference.dequant import dequantize


def load(g: GGUFFile, name: str, shape: tuple[int, ...], reshape_ok: bool = False) -> torch.Tensor:
    """The tensor ``name`` as float32 in torch order ([..., ne1, ne0], trailing 1s dropped) after
    checking its GGUF shape; ``reshape_ok``: any shape of as many elements (llama.cpp's
    ``TENSOR_ALLOW_RESHAPE``) reads into ``shape``."""
    t = check_tensor(g, name, shape, reshape_ok)
    return dequantize(g, t).reshape(torch_shape(shape))


def optional(g: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``load`` if the file has ``name`` (llama.cpp's ``TENSOR_NOT_REQUIRED``), else None."""
    return load(g, name, shape) if name in g.tensors else None


class QKV(NamedTuple):
    wq: torch.Tensor  # [nq, d]
    wk: torch.Tensor  # [nk, d]
    wv: torch.Tensor  # [nv, d]
    bq: torch.Tensor | None  # [nq]; None: the file has no bias
    bk: torch.Tensor | None
    bv: torch.Tensor | None


def load_qkv(g: GGUFFile, prefix: str, d: int, nq: int, nk: int, nv: int) -> QKV:
    """The attention input projections of ``prefix`` (``blk.N.``), fused or split in the file."""
    qkv = prefix + "attn_qkv."
    if qkv + "weight" in g.tensors:
        w = load(g, qkv + "weight", (d, nq + nk + nv))  # [nq + nk + nv, d]
        wq, wk, wv = w.split((nq, nk, nv))
        b = optional(g, qkv + "bias", (nq + nk + nv,))
        if b is not None:
            bq, bk, bv = b.split((nq, nk, nv))
            return QKV(wq, wk, wv, bq, bk, bv)
    else:
        wq = load(g, prefix + "attn_q.weight", (d, nq))
        wk = load(g, prefix + "attn_k.weight", (d, nk))
        wv = load(g, prefix + "attn_v.weight", (d, nv))
    return QKV(
        wq,
        wk,
        wv,
        optional(g, prefix + "attn_q.bias", (nq,)),
        optional(g, prefix + "attn_k.bias", (nk,)),
        optional(g, prefix + "attn_v.bias", (nv,)),
    )
