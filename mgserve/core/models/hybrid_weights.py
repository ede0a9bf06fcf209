"""GGUF -> float32 weights of the qwen3moe / qwen3next layers (llama.cpp tensor names and shapes).

Shapes are checked in GGUF order (ne0 first), as llama.cpp's ``create_tensor`` spells them, except
that trailing dims of 1 are ignored as llama.cpp does: real converters store the shared-expert gate
``ffn_gate_inp_shexp`` as [n_embd, 1] while synthetic files write [n_embd].
"""

from __future__ import annotations

import torch

from mgserve.core.gguf import GGUFError, GGUFFile
from mgserve.core.reference.deltanet import DeltaNetWeights
from mgserve.core.reference.dequant import dequantize
from mgserve.core.reference.gated_attention import AttnWeights
from mgserve.core.reference.moe import MoeWeights
from mgserve.core.spec import ModelSpec
from mgserve.core.spec_hybrid import HybridSpec


def _strip(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def load(g: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``name`` as float32 in torch order ([..., ne1, ne0]) with trailing 1s dropped."""
    t = g.tensor(name)
    if _strip(t.shape) != _strip(shape):
        raise GGUFError(
            f"{g.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
        )
    return dequantize(g, t).reshape(tuple(reversed(_strip(shape))))


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
    return AttnWeights(
        wq=load(g, p + "attn_q.weight", (d, 2 * q if hp.attn_gated else q)),
        wk=load(g, p + "attn_k.weight", (d, kv)),
        wv=load(g, p + "attn_v.weight", (d, kv)),
        wo=load(g, p + "attn_output.weight", (q, d)),
        q_norm=load(g, p + "attn_q_norm.weight", (spec.head_dim,)),
        k_norm=load(g, p + "attn_k_norm.weight", (spec.head_dim,)),
        gated=hp.attn_gated,
    )


def load_deltanet(g: GGUFFile, il: int, spec: ModelSpec, hp: HybridSpec) -> DeltaNetWeights:
    d, p = spec.n_embd, f"blk.{il}."
    if p + "attn_qkv.weight" not in g.tensors:
        raise GGUFError(
            f"{g.path}: layer {il} has no 'attn_qkv' (legacy fused 'ssm_in' files are not "
            "supported; re-convert with a current convert_hf_to_gguf.py)"
        )
    return DeltaNetWeights(
        qkv=load(g, p + "attn_qkv.weight", (d, hp.conv_dim)),
        z=load(g, p + "attn_gate.weight", (d, hp.value_dim)),
        ba=load(g, p + "ssm_ba.weight", (d, 2 * hp.ssm_v_heads)),
        conv=load(g, p + "ssm_conv1d.weight", (hp.ssm_conv, hp.conv_dim)),
        dt_bias=load(g, p + "ssm_dt.bias", (hp.ssm_v_heads,)),
        a=load(g, p + "ssm_a", (hp.ssm_v_heads,)),
        norm=load(g, p + "ssm_norm.weight", (hp.ssm_head_dim,)),
        out=load(g, p + "ssm_out.weight", (hp.value_dim, d)),
    )
