"""The weights qwen4exp adds to the hybrid layers on the device backend, and how they load:
hyper-connection mixes (``HC``: per block and for the head), the QSA indexer of the full-attention
layers, and the PLE layer (the twin of core/models/qwen4exp_weights.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgserve.core.gguf.hparams_qwen4exp import Qwen4ExpSpec
from mgserve.cuda.loader import Loader
from mgserve.cuda.weights import QuantWeight


@dataclass
class HC:
    norm: torch.Tensor  # [hc, d]
    down: QuantWeight  # [r, hc * d]
    up: QuantWeight  # [hc * d, r]
    inject: QuantWeight | None  # [hc, hc * d]


@dataclass
class Indexer:
    q_proj: QuantWeight  # [H_idx * D, d]
    k_proj: QuantWeight  # [D, d]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor


@dataclass
class Ple:
    key: QuantWeight  # [hc * d, n_heads * head_dim]
    value: QuantWeight  # [d, n_heads * head_dim]
    norm_key: torch.Tensor  # [hc, d]
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    conv: torch.Tensor  # [hc * d, K]


def load_hc(ld: Loader, prefix: str, d: int, qp: Qwen4ExpSpec, inject: bool) -> HC:
    """The mix ``prefix`` (``blk.N.hc_attn``, ``blk.N.hc_ffn``, ``output_hc``); the head's has no
    inject."""
    hc_dim, lr = qp.hc * d, qp.hc_lowrank
    return HC(
        norm=ld.vec(f"{prefix}_norm.weight", (d, qp.hc), reshape_ok=True),  # [hc, d]
        down=ld.mat(f"{prefix}_down.weight", (hc_dim, lr)),
        up=ld.mat(f"{prefix}_up.weight", (lr, hc_dim)),
        inject=ld.mat(f"{prefix}_inject.weight", (hc_dim, qp.hc)) if inject else None,
    )


def load_indexer(ld: Loader, il: int, d: int, qp: Qwen4ExpSpec) -> Indexer:
    p, dim = f"blk.{il}.", qp.idx_dim
    return Indexer(
        q_proj=ld.mat(p + "indexer.q_proj.weight", (d, qp.idx_heads * dim)),
        k_proj=ld.mat(p + "indexer.k_proj.weight", (d, dim)),
        q_norm=ld.vec(p + "indexer.q_norm.weight", (dim,)),
        k_norm=ld.vec(p + "indexer.k_norm.weight", (dim,)),
    )


def load_ple(ld: Loader, il: int, d: int, qp: Qwen4ExpSpec) -> Ple:
    assert qp.ple is not None
    p = f"blk.{il}."
    emb, hc_dim = qp.ple.n_heads * qp.ple.head_dim, qp.hc * d
    return Ple(
        key=ld.mat(p + "ple_key.weight", (emb, hc_dim)),
        value=ld.mat(p + "ple_value.weight", (emb, d)),
        norm_key=ld.vec(p + "ple_norm_key.weight", (d, qp.hc), reshape_ok=True),
        norm_query=ld.vec(p + "ple_norm_query.weight", (d, qp.hc), reshape_ok=True),
        norm_conv=ld.vec(p + "ple_norm_conv.weight", (d, qp.hc), reshape_ok=True),
        conv=ld.vec(p + "ple_conv1d.weight", (qp.ple.conv_kernel, hc_dim)),
    )
