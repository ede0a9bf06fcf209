"""The tensor list of a synthetic model and the per-tensor quant types of an unsloth-style
UD-Q4_K_XL file.

Type policy (``ud_q4_k_xl_type``), first rule that matches:

1. F32: 1-D tensors, norm gammas (``*_norm``, ``*_norm_*``), ``ssm_a``, ``ssm_dt``,
   ``ssm_conv1d``, ``ffn_gate_inp(_shexp)`` (llama.cpp's converter forces these to F32 and
   ``llama-quantize`` leaves them alone).
2. BF16: hyper-connection mixing matrices (``hc_*``, ``output_hc_*``), ``ple_conv1d`` and the QSA
   indexer projections: the converter writes them BF16 and quantizing skips them (indexer
   projections explicitly, the rest because the UD mixes keep small sensitive tensors in BF16).
3. Q8_0: the PLE table (8-bit, ~48 GiB at full size) and the tiny DeltaNet ``ssm_alpha``,
   ``ssm_beta``, ``ssm_ba`` (per-head decay and beta gates).
4. Q6_K: ``output``, ``attn_v``, and ``ffn_down_exps``/``ffn_down_shexp`` on llama.cpp's
   "use more bits" layers (first and last eighth, and every third layer between).
5. Q4_K: everything else (``token_embd``, attention, DeltaNet projections, experts).

Shapes are the ones llama.cpp's converter writes (conversion/qwen4exp.py, qwen.py): the
hyper-connection and PLE norm gammas keep the checkpoint's 1-D [n_embd * hc] (llama.cpp creates
them with ``TENSOR_ALLOW_RESHAPE`` and reads them as [n_embd, hc]; see core/gguf/layout.py).

Then the row-width fallback ``llama-quantize`` applies: a K-quant needs ``ne0 % 256 == 0``, so a
640- or 320-wide row takes Q5_0 in place of Q4_K and Q8_0 in place of Q6_K.
"""

from __future__ import annotations

from typing import NamedTuple

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mgserve.core.synth.shapes import ShapeSpec, ple_table

Q = GGMLQuantizationType

_F32_KINDS = {"ssm_a", "ssm_dt", "ssm_conv1d", "ffn_gate_inp", "ffn_gate_inp_shexp"}
_BF16_KINDS = {"ple_conv1d", "indexer.q_proj", "indexer.k_proj"}
_Q8_KINDS = {"per_layer_token_embd", "ssm_alpha", "ssm_beta", "ssm_ba"}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


class TensorPlan(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous row
    ggml_type: GGMLQuantizationType


def use_more_bits(il: int, n_layer: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' down projections get Q6_K."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def ud_q4_k_xl_type(
    kind: str, shape: tuple[int, ...], il: int | None, n_layer: int
) -> GGMLQuantizationType:
    """Quant type of a tensor; ``kind`` is its name without ``blk.N.`` and ``.weight``/``.bias``."""
    if len(shape) == 1 or "norm" in kind.split("_") or kind in _F32_KINDS:
        return Q.F32
    if kind.startswith(("hc_", "output_hc_")) or kind in _BF16_KINDS:
        t = Q.BF16
    elif kind in _Q8_KINDS:
        t = Q.Q8_0
    elif kind in ("output", "attn_v"):
        t = Q.Q6_K
    elif kind in ("ffn_down_exps", "ffn_down_shexp") and use_more_bits(il or 0, n_layer):
        t = Q.Q6_K
    else:
        t = Q.Q4_K
    if shape[0] % GGML_QUANT_SIZES[t][0] != 0:
        t = _FALLBACK.get(t, Q.F16)
    if shape[0] % GGML_QUANT_SIZES[t][0] != 0:
        t = Q.F16
    return t


def tensor_plan(spec: ShapeSpec) -> list[TensorPlan]:
    """Every tensor llama.cpp's loader creates for ``spec``, with its shape and quant type."""
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
        out.append(TensorPlan(name, shape, ud_q4_k_xl_type(kind, shape, il, spec.n_layer)))

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
