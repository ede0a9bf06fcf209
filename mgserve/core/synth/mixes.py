"""The quant-type mixes a synthetic model can be written in: which GGML type each tensor gets.

A mix maps a tensor (its kind, i.e. its name without ``blk.N.`` and ``.weight``/``.bias``, its
GGUF shape and its layer) to a type, and names the ``general.file_type`` the file then carries.
Every mix starts from what llama.cpp's converter writes for a BF16 conversion
(``converted_type``): F32 for 1-D tensors, ``*_norm`` gammas, ``ffn_gate_inp(_shexp)`` and
``ssm_conv1d``, BF16 for everything else.

``q4_k_m`` is what ``llama-quantize <bf16 file> Q4_K_M`` makes of that file (llama.cpp's
``src/llama-quant.cpp``; tests/data/q4_k_m_types.json records its choices), first rule that
matches:

1. Kept as converted: 1-D tensors, ``*_norm``, ``ffn_gate_inp`` and ``ssm_conv1d`` (F32) and the
   QSA indexer projections ``indexer.q_proj``/``indexer.k_proj`` (BF16).
2. Q6_K: ``output``.
3. With exactly 8 experts llama.cpp spends more on attention: Q8_0 for ``attn_k`` and the
   "attention-V-like" tensors (``attn_v`` and the DeltaNet ``attn_qkv``), Q5_K for
   ``attn_output``.
4. Attention-V-like tensors (one per layer): Q6_K on the "use more bits" layers (first and last
   eighth, every third between), else Q4_K.
5. Names containing ``ffn_down`` (experts, shared expert and, by that substring match, the
   hyper-connection ``hc_ffn_down``): Q6_K on the "use more bits" layers, else Q4_K. With one
   expert llama.cpp counts these tensors instead of reading their layer (``_down_layer``).
6. Q4_K: everything else (``token_embd``, ``per_layer_token_embd``, attention, DeltaNet and
   hyper-connection projections, ``ple_conv1d``, experts).

then the row-width fallback: a K-quant needs ``ne0 % 256 == 0``, so a 640-, 320- or 160-wide row
takes Q5_0 in place of Q4_K and Q8_0 in place of Q6_K, and a row too narrow even for a 32-value
block (``ple_conv1d``'s 4 taps) F16.

``bf16`` is the converter's output itself. ``ud-q4_k_xl`` is an unsloth-style UD-Q4_K_XL mix
(llama-quantize Q4_K_M with per-tensor overrides), the same except: BF16 hyper-connection
matrices (``hc_*``, ``output_hc_*``) and ``ple_conv1d``; Q8_0 for the PLE table and the tiny
DeltaNet gates ``ssm_alpha``/``ssm_beta``/``ssm_ba``; Q6_K for every ``attn_v``, Q4_K for every
``attn_qkv``, and no 8-expert or 1-expert special cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from mgserve.core.synth.shapes import ShapeSpec

Q = GGMLQuantizationType

_F32_KINDS = {"ssm_a", "ssm_dt", "ssm_conv1d", "ffn_gate_inp", "ffn_gate_inp_shexp"}
_KEPT_KINDS = {"indexer.q_proj", "indexer.k_proj"}  # llama-quantize never touches these
_ATTN_V_LIKE = {"attn_v", "attn_qkv"}
_DOWN_ORDER = ("ffn_down_exps", "ffn_down_shexp", "hc_ffn_down")  # by name, as llama.cpp sorts
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

# the ud mix's own choices
_UD_BF16_KINDS = {"ple_conv1d", *_KEPT_KINDS}
_UD_Q8_KINDS = {"per_layer_token_embd", "ssm_alpha", "ssm_beta", "ssm_ba"}


def use_more_bits(il: int, n_layer: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' V and down projections get Q6_K."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def converted_type(kind: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """The type llama.cpp's converter writes a tensor in for a BF16 conversion."""
    if len(shape) == 1 or kind.endswith("_norm") or kind in _F32_KINDS:
        return Q.F32
    return Q.BF16


def fallback(t: GGMLQuantizationType, ne0: int) -> GGMLQuantizationType:
    """llama-quantize's answer to a row of ``ne0`` values that blocks of ``t`` cannot tile."""
    if ne0 % GGML_QUANT_SIZES[t][0] == 0:
        return t
    t = _FALLBACK.get(t, t)
    return t if ne0 % GGML_QUANT_SIZES[t][0] == 0 else Q.F16


def _down_layer(kind: str, il: int, spec: ShapeSpec) -> int:
    """The layer index llama.cpp's down-projection rule uses: the tensor's layer when the model
    has experts, else a counter over the tensors whose name contains ``ffn_down``, in llama.cpp's
    (layer, name) order."""
    if spec.n_expert > 1:
        return il
    per_layer = _DOWN_ORDER if spec.hc else _DOWN_ORDER[:2]
    return len(per_layer) * il + per_layer.index(kind)


def q4_k_m_type(
    kind: str, shape: tuple[int, ...], il: int | None, spec: ShapeSpec
) -> GGMLQuantizationType:
    """``llama-quantize ... Q4_K_M``'s type for a tensor of a BF16 conversion."""
    t = converted_type(kind, shape)
    if t == Q.F32 or kind in _KEPT_KINDS:
        return t
    n8 = spec.n_expert == 8
    # one attention-V-like tensor per layer, so llama.cpp's counter over them is the layer index
    if kind == "output":
        t = Q.Q6_K
    elif kind in _ATTN_V_LIKE:
        t = Q.Q8_0 if n8 else Q.Q6_K if use_more_bits(il or 0, spec.n_layer) else Q.Q4_K
    elif kind == "attn_k" and n8:
        t = Q.Q8_0
    elif kind == "attn_output" and n8:
        t = Q.Q5_K
    elif "ffn_down" in kind and use_more_bits(_down_layer(kind, il or 0, spec), spec.n_layer):
        t = Q.Q6_K
    else:
        t = Q.Q4_K
    return fallback(t, shape[0])


def ud_q4_k_xl_type(
    kind: str, shape: tuple[int, ...], il: int | None, spec: ShapeSpec
) -> GGMLQuantizationType:
    """The unsloth-style UD-Q4_K_XL type of a tensor."""
    t = converted_type(kind, shape)
    if t == Q.F32:
        return t
    if kind.startswith(("hc_", "output_hc_")) or kind in _UD_BF16_KINDS:
        return Q.BF16
    if kind in _UD_Q8_KINDS:
        t = Q.Q8_0
    elif kind in ("output", "attn_v"):
        t = Q.Q6_K
    elif kind in ("ffn_down_exps", "ffn_down_shexp") and use_more_bits(il or 0, spec.n_layer):
        t = Q.Q6_K
    else:
        t = Q.Q4_K
    return fallback(t, shape[0])


TypeRule = Callable[[str, tuple[int, ...], int | None, ShapeSpec], GGMLQuantizationType]


class Mix(NamedTuple):
    type_of: TypeRule
    file_type: int  # general.file_type; an unsloth UD file says Q4_K_M, as llama-quantize wrote it


def _converted(
    kind: str, shape: tuple[int, ...], il: int | None, spec: ShapeSpec
) -> GGMLQuantizationType:
    return converted_type(kind, shape)


MIXES: dict[str, Mix] = {
    "q4_k_m": Mix(q4_k_m_type, LlamaFileType.MOSTLY_Q4_K_M),
    "ud-q4_k_xl": Mix(ud_q4_k_xl_type, LlamaFileType.MOSTLY_Q4_K_M),
    "bf16": Mix(_converted, LlamaFileType.MOSTLY_BF16),  # the input llama-quantize starts from
}
DEFAULT_MIX = "q4_k_m"


def mix_of(name: str) -> Mix:
    if name not in MIXES:
        raise ValueError(f"unknown quant mix {name!r} (known: {', '.join(MIXES)})")
    return MIXES[name]
