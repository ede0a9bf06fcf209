"""The tensor list of a synthetic model: every tensor llama.cpp's loader creates for a
``ShapeSpec``, with its GGUF shape and the quant type a mix (mixes.py) gives it.

Shapes are the ones llama.cpp's converter writes (conversion/qwen4exp.py, qwen.py): the
hyper-connection and PLE norm gammas keep the checkpoint's 1-D [n_embd * hc] (llama.cpp creates
them with ``TENSOR_ALLOW_RESHAPE`` and reads them as [n_embd, hc]; see core/gguf/layout.py).
"""

from __future__ import annotations

from typing import NamedTuple

from gguf.constants import GGMLQuantizationType

from mgserve.core.synth.mixes import DEFAULT_MIX, mix_of
from mgserve.core.synth.shapes import ShapeSpec, ple_table


class TensorPlan(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous row
    ggml_type: GGMLQuantizationType


def tensor_plan(spec: ShapeSpec, mix: str = DEFAULT_MIX) -> list[TensorPlan]:
    """Every tensor llama.cpp's loader creates for ``spec``, with its shape and its type in
    ``mix`` (a name of ``mixes.MIXES``)."""
    type_of = mix_of(mix).type_of
    e, v = spec.n_embd, spec.vocab.n_vocab
    hc_dim, lr = spec.hc * e, spec.hc_lowrank
    key_dim = spec.ssm_k_heads * spec.ssm_head_dim
    value_dim = spec.ssm_v_heads * spec.ssm_head_dim
    q_dim, kv_dim = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    ne, ff, sh = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp

    out: list[TensorPlan] = []

    def add(
        kind: str, shape: tuple[int, ...], il: int | None = None, suffix: str = ".weight"
    ) -> None:
        name = (f"blk.{il}." if il is not None else "") + kind + suffix
        out.append(TensorPlan(name, shape, type_of(kind, shape, il, spec)))

    add("token_embd", (e, v))
    if spec.ple_layer is not None:
        add("per_layer_token_embd", (spec.ple_dim, ple_table(spec)[2]))
    if spec.hc:
        add("output_hc_norm", (hc_dim,))  # 1-D as the converter writes it
        add("output_hc_down", (hc_dim, lr))
        add("output_hc_up", (lr, hc_dim))
    else:
        add("output_norm", (e,))
    add("output", (e, v))

    for il in range(spec.n_layer):
        if spec.hc:
            for part in ("attn", "ffn"):
                add(f"hc_{part}_norm", (hc_dim,), il)
                add(f"hc_{part}_down", (hc_dim, lr), il)
                add(f"hc_{part}_up", (lr, hc_dim), il)
                add(f"hc_{part}_inject", (hc_dim, spec.hc), il)
        else:
            add("attn_norm", (e,), il)
            add("post_attention_norm", (e,), il)
        if spec.is_recurrent(il):
            add("attn_qkv", (e, 2 * key_dim + value_dim), il)
            add("attn_gate", (e, value_dim), il)
            add("ssm_conv1d", (spec.ssm_conv, 2 * key_dim + value_dim), il)
            add("ssm_dt", (spec.ssm_v_heads,), il, ".bias")
            add("ssm_a", (spec.ssm_v_heads,), il, "")
            if spec.hc:
                add("ssm_beta", (e, spec.ssm_v_heads), il)
                add("ssm_alpha", (e, spec.ssm_v_heads), il)
            else:
                add("ssm_ba", (e, 2 * spec.ssm_v_heads), il)
            add("ssm_norm", (spec.ssm_head_dim,), il)
            add("ssm_out", (value_dim, e), il)
        else:
            add("attn_q", (e, 2 * q_dim), il)  # [q | gate] interleaved per head
            add("attn_k", (e, kv_dim), il)
            add("attn_v", (e, kv_dim), il)
            add("attn_output", (q_dim, e), il)
            add("attn_q_norm", (spec.head_dim,), il)
            add("attn_k_norm", (spec.head_dim,), il)
            if spec.indexer_heads:
                add("indexer.q_proj", (e, spec.indexer_heads * spec.indexer_dim), il)
                add("indexer.k_proj", (e, spec.indexer_dim), il)
                add("indexer.q_norm", (spec.indexer_dim,), il)
                add("indexer.k_norm", (spec.indexer_dim,), il)
        if il == spec.ple_layer:
            add("ple_key", (e, hc_dim), il)
            add("ple_value", (e, e), il)
            add("ple_norm_key", (hc_dim,), il)
            add("ple_norm_query", (hc_dim,), il)
            add("ple_norm_conv", (hc_dim,), il)
            add("ple_conv1d", (spec.ple_conv, hc_dim), il)
        add("ffn_gate_inp", (e, ne), il)
        add("ffn_gate_exps", (e, ff, ne), il)
        add("ffn_up_exps", (e, ff, ne), il)
        add("ffn_down_exps", (ff, e, ne), il)
        add("ffn_gate_inp_shexp", (e,), il)
        add("ffn_gate_shexp", (e, sh), il)
        add("ffn_up_shexp", (e, sh), il)
        add("ffn_down_shexp", (sh, e), il)
    return out
