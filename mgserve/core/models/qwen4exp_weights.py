"""GGUF -> float32 weights of the qwen4exp-only parts: hyper-connections, the QSA indexer, the PLE
layer, and the Gated DeltaNet in its qwen4exp layout (llama.cpp names and GGUF shapes, see
src/models/qwen4exp.cpp ``load_arch_tensors``).

The hyper-connection and PLE norm gammas are created with ``TENSOR_ALLOW_RESHAPE``: the converter
writes them 1-D [n_embd * hc] (the checkpoint's shape), the loader asks for [n_embd, hc]; both hold
the streams one after another, so either reads as [hc, d] here.

DeltaNet value heads: the converter stores them tiled ([G0_v0, G1_v0, ..., G0_v1, ...]: value head
j reads key head j % H_k, for ggml's broadcast) and splits beta and alpha into ``ssm_beta`` /
``ssm_alpha``. We undo the tiling at load, back to HF's grouped order (value head j reads key head
j // r), and pack beta/alpha as qwen3next's ``ssm_ba``, so ``reference.deltanet`` runs unchanged.
"""

from __future__ import annotations

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.hparams_qwen4exp import Qwen4ExpSpec
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.tensors import load
from mgserve.core.reference.deltanet import DeltaNetWeights
from mgserve.core.reference.hyper_connections import HCWeights
from mgserve.core.reference.ple import PleWeights
from mgserve.core.reference.qsa import IndexerWeights


def load_hc(g: GGUFFile, prefix: str, d: int, qp: Qwen4ExpSpec, inject: bool) -> HCWeights:
    """``{prefix}_norm/_down/_up(/_inject)``, e.g. prefix ``blk.0.hc_attn`` or ``output_hc``."""
    hc_dim, lr = qp.hc * d, qp.hc_lowrank
    return HCWeights(
        norm=load(g, f"{prefix}_norm.weight", (d, qp.hc), reshape_ok=True),  # [hc, d]
        down=load(g, f"{prefix}_down.weight", (hc_dim, lr)),  # [r, hc * d]
        up=load(g, f"{prefix}_up.weight", (lr, hc_dim)),  # [hc * d, r]
        inject=load(g, f"{prefix}_inject.weight", (hc_dim, qp.hc)) if inject else None,
    )


def _untile(x: torch.Tensor, dim: int, hp: HybridSpec, width: int) -> torch.Tensor:
    """Value heads (blocks of ``width`` along ``dim``) from tiled back to grouped order."""
    hk, r = hp.ssm_k_heads, hp.ssm_v_heads // hp.ssm_k_heads
    shape = list(x.shape)
    tiled = x.reshape(*shape[:dim], r, hk, width, *shape[dim + 1 :])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def load_deltanet(g: GGUFFile, il: int, spec: ModelSpec, hp: HybridSpec) -> DeltaNetWeights:
    d, p, kd, dv = spec.n_embd, f"blk.{il}.", hp.key_dim, hp.ssm_head_dim
    hv, hk = hp.ssm_v_heads, hp.ssm_k_heads
    qkv = load(g, p + "attn_qkv.weight", (d, hp.conv_dim))  # [conv_dim, d]
    conv = load(g, p + "ssm_conv1d.weight", (hp.ssm_conv, hp.conv_dim))  # [conv_dim, K]
    beta = _untile(load(g, p + "ssm_beta.weight", (d, hv)), 0, hp, 1)  # [H_v, d]
    alpha = _untile(load(g, p + "ssm_alpha.weight", (d, hv)), 0, hp, 1)
    ba = torch.cat((beta.view(hk, -1, d), alpha.view(hk, -1, d)), dim=1).reshape(2 * hv, d)
    return DeltaNetWeights(
        qkv=torch.cat((qkv[: 2 * kd], _untile(qkv[2 * kd :], 0, hp, dv))),
        z=_untile(load(g, p + "attn_gate.weight", (d, hp.value_dim)), 0, hp, dv),
        ba=ba,  # [2 H_v, d] grouped per key head as [beta (r) | alpha (r)]
        conv=torch.cat((conv[: 2 * kd], _untile(conv[2 * kd :], 0, hp, dv))),
        dt_bias=_untile(load(g, p + "ssm_dt.bias", (hv,)), 0, hp, 1),
        a=_untile(load(g, p + "ssm_a", (hv,)), 0, hp, 1),
        norm=load(g, p + "ssm_norm.weight", (dv,)),
        out=_untile(load(g, p + "ssm_out.weight", (hp.value_dim, d)), 1, hp, dv),
        sigmoid_gate=True,
    )


def load_indexer(g: GGUFFile, il: int, spec: ModelSpec, qp: Qwen4ExpSpec) -> IndexerWeights:
    d, p, dim = spec.n_embd, f"blk.{il}.indexer.", qp.idx_dim
    return IndexerWeights(
        q_proj=load(g, p + "q_proj.weight", (d, qp.idx_heads * dim)),
        k_proj=load(g, p + "k_proj.weight", (d, dim)),
        q_norm=load(g, p + "q_norm.weight", (dim,)),
        k_norm=load(g, p + "k_norm.weight", (dim,)),
    )


def load_ple(g: GGUFFile, il: int, spec: ModelSpec, qp: Qwen4ExpSpec) -> PleWeights:
    assert qp.ple is not None
    d, p, hc_dim = spec.n_embd, f"blk.{il}.", qp.hc * spec.n_embd
    emb = qp.ple.n_heads * qp.ple.head_dim  # concatenated rows of one token
    return PleWeights(
        key=load(g, p + "ple_key.weight", (emb, hc_dim)),
        value=load(g, p + "ple_value.weight", (emb, d)),
        norm_key=load(g, p + "ple_norm_key.weight", (d, qp.hc), reshape_ok=True),
        norm_query=load(g, p + "ple_norm_query.weight", (d, qp.hc), reshape_ok=True),
        norm_conv=load(g, p + "ple_norm_conv.weight", (d, qp.hc), reshape_ok=True),
        conv=load(g, p + "ple_conv1d.weight", (qp.ple.conv_kernel, hc_dim)),
    )
