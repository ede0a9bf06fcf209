"""``ModelSpec``: one frozen record of a dense model's hyperparameters, read from ``{arch}.*`` keys.

Facts taken from llama.cpp (src/llama-model.cpp, src/models/*.cpp, src/llama-hparams.cpp):
- RoPE: ``llama`` rotates consecutive pairs (``norm``; the converter permutes Q/K rows so that this
  equals Hugging Face's rotate-half); every other architecture rotates (i, i + d/2) pairs
  (``neox``).
- Gemma 3 sliding window: layer ``il`` is local iff ``il % pattern < pattern - 1`` with pattern 6
  (``{arch}.attention.sliding_window_pattern`` may override it), so layers 5, 11, 17 are global.
  Local layers use RoPE base ``{arch}.rope.freq_base_swa`` (default 10000), global ones the file's.
- Gemma 3 attention scale: 1/sqrt(n_embd/n_head) for the 62-layer 27B, else 1/sqrt(head_dim).
- A key at position q sees key position k iff k <= q and, on a sliding layer, q - k < window.

Key variants llama.cpp's loader accepts (src/llama-model.cpp ``load_hparams``), read the same way:
- ``attention.head_count``, ``head_count_kv``, ``feed_forward_length`` (and for MoE
  ``expert_feed_forward_length``, ``expert_used_count``) are a scalar or one value per layer
  (``get_key_or_arr``); mgserve needs one value for all layers (zeros, which hybrid files give
  layers without the feature, are skipped);
- ``block_count`` counts the ``nextn_predict_layers`` multi-token-prediction blocks a converter
  appends (Qwen3-Next): the model proper is the first ``block_count - nextn_predict_layers``;
- a missing ``rope.scaling.type`` means linear; the factor is ``rope.scaling.factor``, or the old
  ``rope.scale_linear``; 0 or absent: no scaling;
- ``attention.key_length`` / ``value_length`` default to ``embedding_length / head_count``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

from mgserve.core.gguf.reader import GGUFError, GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# qwen4exp's M-RoPE is NeoX RoPE for text (hparams_qwen4exp.py); MoE archs: hparams_hybrid.py
_NEOX_ARCHS = ("qwen2", "qwen3", "gemma3", "qwen3moe", "qwen3next", "qwen4exp")


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # general.architecture
    name: str  # general.name (or the file name)
    n_layer: int
    n_embd: int  # residual width
    n_ff: int  # MLP hidden width
    n_head: int
    n_head_kv: int
    head_dim: int  # key_length (== value_length for the supported archs)
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float  # global (full attention) layers
    rope_base_swa: float  # sliding-window layers (gemma3); equals rope_base elsewhere
    rope_scale: float = 1.0  # linear position scale (1 / rope.scaling.factor)
    n_rot: int = 0  # dims rotated per head; 0 -> head_dim
    sliding_window: int = 0  # 0: no sliding-window layers
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window; () -> none
    attn_scale: float = 0.0  # multiplies q.k; 0 -> 1/sqrt(head_dim)
    attn_softcap: float = 0.0  # tanh soft-capping of attention scores (0: off)
    final_softcap: float = 0.0  # tanh soft-capping of output logits (0: off)
    tied_output: bool = False  # no output.weight: the output projection is token_embd
    n_expert: int = 0  # llama only (Mixtral-style files): routed experts of n_ff each per layer
    n_expert_used: int = 0  # top-k of those (softmax routing, renormalised, as llama.cpp)
    # derived in __post_init__
    rope_neox: bool = field(init=False)  # True: rotate (i, i + n_rot/2); False: (2i, 2i + 1)
    qkv_bias: bool = field(init=False)  # qwen2 has biases on q, k, v
    qk_norm: bool = field(init=False)  # qwen3, gemma3 RMS-normalize q and k per head
    gemma: bool = field(init=False)  # embedding * sqrt(n_embd), GELU MLP, post-norms
    n_gqa: int = field(init=False)  # query heads per KV head

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ValueError(
                f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}"
            )
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"expert_used_count {self.n_expert_used} not in 1..{self.n_expert}")
        set_ = object.__setattr__  # frozen: derived fields are set once, here
        set_(self, "n_rot", self.n_rot or self.head_dim)
        set_(self, "swa_layers", self.swa_layers or (False,) * self.n_layer)
        set_(self, "attn_scale", self.attn_scale or 1.0 / math.sqrt(self.head_dim))
        set_(self, "rope_neox", self.arch in _NEOX_ARCHS)
        set_(self, "qkv_bias", self.arch == "qwen2")
        set_(self, "qk_norm", self.arch in ("qwen3", "gemma3", "qwen3moe", "qwen3next"))
        set_(self, "gemma", self.arch == "gemma3")
        set_(self, "n_gqa", self.n_head // self.n_head_kv)
        if len(self.swa_layers) != self.n_layer:
            raise ValueError(f"swa_layers has {len(self.swa_layers)} entries, want {self.n_layer}")

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _swa_pattern(g: GGUFFile, arch: str, n_layer: int) -> tuple[bool, ...]:
    raw = g.get(f"{arch}.attention.sliding_window_pattern", 6)
    if not isinstance(raw, int):  # an explicit per-layer array
        flags = tuple(bool(x) for x in raw)
        if len(flags) != n_layer:
            raise GGUFError(
                f"{g.path}: {arch}.attention.sliding_window_pattern has {len(flags)} entries, "
                f"want {n_layer}"
            )
        return flags
    if raw == 0:
        return (True,) * n_layer
    return tuple(il % raw < raw - 1 for il in range(n_layer))


def layer_int(g: GGUFFile, key: str, n_layer: int, default: int | None = None) -> int:
    """A key llama.cpp reads with ``get_key_or_arr``: a scalar, or an array of one value per
    layer, which must then be the same on every layer that has one (nonzero); GGUFError names the
    key when it is missing (and ``default`` is None) or differs between layers."""
    raw = g.get(key)
    if raw is None:
        if default is None:
            raise GGUFError(f"{g.path}: required metadata key {key!r} is missing")
        return default
    if isinstance(raw, Number):
        return int(raw)  # type: ignore[call-overload]
    values = {int(x) for x in list(raw)[:n_layer]} - {0}
    if len(values) > 1:
        raise GGUFError(
            f"{g.path}: {key} differs between layers ({sorted(values)}); mgserve needs one value "
            "for every layer"
        )
    return values.pop() if values else 0


def n_trunk_layers(g: GGUFFile, arch: str) -> int:
    """Layers of the model proper: ``block_count`` less the appended MTP (nextn) blocks."""
    n_all = int(g.require(f"{arch}.block_count"))
    nextn = int(g.get(f"{arch}.nextn_predict_layers", 0))
    if not 0 <= nextn < n_all:
        raise GGUFError(f"{g.path}: {arch}.nextn_predict_layers {nextn} not in 0..{n_all - 1}")
    return n_all - nextn


def common_fields(g: GGUFFile, arch: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields every supported architecture reads the same way from ``{arch}.*``
    keys and the tensor table; GGUFError names a missing key or tensor, or an unsupported value.
    Callers add ``n_ff`` and what is their own (sliding windows, soft-capping)."""

    def req(key: str) -> Any:
        return g.require(f"{arch}.{key}")

    n_layer = n_trunk_layers(g, arch)
    n_embd = int(req("embedding_length"))
    n_head = layer_int(g, f"{arch}.attention.head_count", n_layer)
    if n_head < 1:
        raise GGUFError(f"{g.path}: {arch}.attention.head_count must be positive")
    head_dim = int(g.get(f"{arch}.attention.key_length", n_embd // n_head))
    v_dim = int(g.get(f"{arch}.attention.value_length", n_embd // n_head))
    if v_dim != head_dim:
        raise GGUFError(f"{g.path}: value_length {v_dim} != key_length {head_dim} is not supported")
    for key in ("attention.key_length_swa", "attention.value_length_swa"):
        if int(g.get(f"{arch}.{key}", head_dim)) != head_dim:
            raise GGUFError(f"{g.path}: {arch}.{key} != key_length is not supported")
    if "token_embd.weight" not in g.tensors:
        raise GGUFError(f"{g.path}: required tensor 'token_embd.weight' is missing")
    scaled = [n for n in g.tensors if n.endswith((".scale", ".input_scale"))]
    if scaled:  # llama.cpp multiplies the matching product by these (NVFP4 / ModelOpt exports)
        raise GGUFError(f"{g.path}: tensor {scaled[0]!r}: per-tensor scales are not supported")
    scaling = g.get(f"{arch}.rope.scaling.type", "linear")
    factor = float(
        g.get(f"{arch}.rope.scaling.factor", g.get(f"{arch}.rope.scale_linear", 0.0)) or 0.0
    )
    if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
        raise GGUFError(f"{g.path}: {arch}.rope.scaling.type {scaling!r} is not supported")
    rope_base = float(g.get(f"{arch}.rope.freq_base", 10000.0))
    n_rot = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    if int(g.get(f"{arch}.rope.dimension_count_swa", n_rot)) != n_rot:
        raise GGUFError(f"{g.path}: {arch}.rope.dimension_count_swa != dimension_count")
    return dict(
        arch=arch,
        name=str(g.get("general.name", g.path.stem)),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=layer_int(g, f"{arch}.attention.head_count_kv", n_layer, n_head),
        head_dim=head_dim,
        n_vocab=int(g.tensors["token_embd.weight"].shape[1]),
        n_ctx_train=int(req("context_length")),
        rms_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_base=rope_base,
        rope_base_swa=rope_base,
        rope_scale=1.0 / factor if scaling == "linear" and factor else 1.0,
        n_rot=n_rot,
        tied_output="output.weight" not in g.tensors,
    )


def spec_from_gguf(g: GGUFFile) -> ModelSpec:
    """Read the hyperparameters of a supported dense architecture; GGUFError names what is wrong."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"{g.path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHS)})"
        )
    fields = common_fields(g, arch)
    n_layer, n_embd, n_head = fields["n_layer"], fields["n_embd"], fields["n_head"]
    window = int(g.get(f"{arch}.attention.sliding_window", 0)) if arch == "gemma3" else 0
    swa = _swa_pattern(g, arch, n_layer) if window > 0 else (False,) * n_layer
    if window:
        fields["rope_base_swa"] = float(g.get(f"{arch}.rope.freq_base_swa", 10000.0))
    attn_scale = 0.0
    if arch == "gemma3" and n_layer == 62:  # gemma 3 27B, see the module docstring
        attn_scale = 1.0 / math.sqrt(n_embd / n_head)
    n_expert = int(g.get(f"{arch}.expert_count", 0)) if arch == "llama" else 0
    try:
        return ModelSpec(
            **fields,
            n_expert=n_expert,
            n_expert_used=layer_int(g, f"{arch}.expert_used_count", n_layer, 0) if n_expert else 0,
            n_ff=layer_int(g, f"{arch}.feed_forward_length", fields["n_layer"]),
            sliding_window=window,
            swa_layers=swa,
            attn_scale=attn_scale,
            # llama.cpp reads no attention soft-capping for these archs, and the final one for
            # gemma3 only (a key another converter left behind changes nothing there)
            final_softcap=float(g.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0)
            if arch == "gemma3"
            else 0.0,
        )
    except ValueError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{g.path}: inconsistent hyperparameters: {e}") from e
