"""GGUF -> float32 weights of the qwen3moe / qwen3next layers (llama.cpp tensor names and shapes,
checked by ``core.gguf.layout``: trailing 1s ignored, as llama.cpp does).

Forms llama.cpp loads besides the plain one: routed experts as fused ``ffn_gate_up_exps``;
attention q/k/v fused as ``attn_qkv`` (see tensors.py); and, for qwen3next DeltaNet layers, the
legacy fused ``ssm_in`` ([q | k | v | z] per key head) of files converted before ``attn_qkv`` /
``attn_gate`` existed.
"""

from __future__ import annotations

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.models.tensors import load, load_qkv
from mgserve.core.reference.deltanet import DeltaNetWeights
from mgserve.core.reference.gated_attention import AttnWeights
from mgserve.core.reference.moe import MoeWeights

__all__ = ["load", "load_attn", "load_deltanet", "load_moe", "ssm_in_rows"]


def load_moe(g: GGUFFile, il: int, spec: ModelSpec, hp: HybridSpec) -> MoeWeights:
    """Routed experts (separate ``ffn_gate_exps``/``ffn_up_exps`` or fused ``ffn_gate_up_exps``,
    gate rows first) and, when the file has one, the sigmoid-gated shared expert."""
    d, ff, ne, p = spec.n_embd, hp.n_ff_exp, hp.n_expert, f"blk.{il}."
    if p + "ffn_gate_up_exps.weight" in g.tensors:
        gate_up = load(g, p + "ffn_gate_up_exps.weight", (d, 2 * ff, ne))  # [E, 2 ff, d]
        gate, up = gate_up[:, :ff], gate_up[:, ff:]
    else:
        gate = load(g, p + "ffn_gate_exps.weight", (d, ff, ne))  # [E, ff, d]
        up = load(g, p + "ffn_up_exps.weight", (d, ff, ne))
    w = MoeWeights(
        router=load(g, p + "ffn_gate_inp.weight", (d, ne)),
        gate=gate,
        up=up,
        down=load(g, p + "ffn_down_exps.weight", (ff, d, ne)),  # [E, d, ff]
    )
    if hp.n_ff_shexp:
        sh = hp.n_ff_shexp
        w.shexp_gate = load(g, p + "ffn_gate_shexp.weight", (d, sh))
        w.shexp_up = load(g, p + "ffn_up_shexp.weight", (d, sh))
        w.shexp_down = load(g, p + "ffn_down_shexp.weight", (sh, d))
        if p + "ffn_gate_inp_shexp.weight" in g.tensors:
            w.shexp_gate_inp = load(g, p + "ffn_gate_inp_shexp.weight", (d,))
    return w


def load_attn(g: GGUFFile, il: int, spec: ModelSpec, hp: HybridSpec) -> AttnWeights:
    d, q, kv, p = spec.n_embd, spec.q_dim, spec.kv_dim, f"blk.{il}."
    qkv = load_qkv(g, p, d, 2 * q if hp.attn_gated else q, kv, kv)
    return AttnWeights(
        wq=qkv.wq,
        wk=qkv.wk,
        wv=qkv.wv,
        wo=load(g, p + "attn_output.weight", (q, d)),
        q_norm=load(g, p + "attn_q_norm.weight", (spec.head_dim,)),
        k_norm=load(g, p + "attn_k_norm.weight", (spec.head_dim,)),
        gated=hp.attn_gated,
        bq=qkv.bq,
        bk=qkv.bk,
        bv=qkv.bv,
    )


def load_deltanet(g: GGUFFile, il: int, spec: ModelSpec, hp: HybridSpec) -> DeltaNetWeights:
    d, p = spec.n_embd, f"blk.{il}."
    if p + "attn_qkv.weight" in g.tensors:
        qkv = load(g, p + "attn_qkv.weight", (d, hp.conv_dim))  # [conv_dim, d]
        z = load(g, p + "attn_gate.weight", (d, hp.value_dim))  # [value_dim, d]
    elif p + "ssm_in.weight" in g.tensors:
        qkv_rows, z_rows = ssm_in_rows(hp)
        fused = load(g, p + "ssm_in.weight", (d, hp.conv_dim + hp.value_dim))
        qkv, z = fused[qkv_rows], fused[z_rows]
    else:
        raise GGUFError(f"{g.path}: layer {il} has neither 'attn_qkv' nor the legacy 'ssm_in'")
    return DeltaNetWeights(
        qkv=qkv,
        z=z,
        ba=load(g, p + "ssm_ba.weight", (d, 2 * hp.ssm_v_heads)),
        conv=load(g, p + "ssm_conv1d.weight", (hp.ssm_conv, hp.conv_dim)),
        dt_bias=load(g, p + "ssm_dt.bias", (hp.ssm_v_heads,)),
        a=load(g, p + "ssm_a", (hp.ssm_v_heads,)),
        norm=load(g, p + "ssm_norm.weight", (hp.ssm_head_dim,)),
        out=load(g, p + "ssm_out.weight", (hp.value_dim, d)),
    )


def ssm_in_rows(hp: HybridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a legacy ``ssm_in`` [(2 dk + 2 r dv) per key head, d] that make ``attn_qkv``
    ([q of every key head | k | v], v grouped per key head) and ``attn_gate`` (z, grouped), as
    llama.cpp's qwen3next ``build_qkvz`` views them: int64 [conv_dim] and [value_dim]."""
    hk, dk = hp.ssm_k_heads, hp.ssm_head_dim
    vw = hp.ssm_v_heads // hk * hp.ssm_head_dim  # v (and z) rows per key head
    group = torch.arange(hk)[:, None] * (2 * dk + 2 * vw)  # [hk, 1] first row of each group
    q = (group + torch.arange(dk)).flatten()
    k = (group + dk + torch.arange(dk)).flatten()
    v = (group + 2 * dk + torch.arange(vw)).flatten()
    z = (group + 2 * dk + vw + torch.arange(vw)).flatten()
    return torch.cat((q, k, v)), z
