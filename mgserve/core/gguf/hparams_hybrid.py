"""``HybridSpec``: the MoE and Gated DeltaNet hyperparameters of ``qwen3moe`` and ``qwen3next``.

``ModelSpec`` (hparams.py) keeps the dense part (widths, heads, RoPE, norms); this record adds what
the two MoE architectures need, read from ``{arch}.*`` keys the way llama.cpp reads them
(src/models/qwen3moe.cpp, src/models/qwen3next.cpp, src/llama-graph.cpp ``build_moe_ffn``):

- Routing is softmax over all experts, top ``expert_used_count``, and the chosen weights are always
  renormalised to sum 1: llama.cpp passes ``norm_w = true`` for both archs and reads neither
  ``{arch}.expert_weights_norm`` nor ``expert_weights_scale`` for them (HF's ``norm_topk_prob`` is
  true in the released Qwen3-MoE and Qwen3-Next configs).
- qwen3next (and qwen4exp, whose extras are in hparams_qwen4exp.py): layer ``il`` is a Gated
  DeltaNet layer iff ``(il + 1) % full_attention_interval``
  is not 0, unless ``{arch}.attention.recurrent_layers`` lists them; DeltaNet key heads are
  ``ssm.group_count``, value heads ``ssm.time_step_rank``, both head dims ``ssm.state_size``; full
  attention rotates only the first ``rope.dimension_count`` dims of each head (NeoX pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mgserve.core.gguf.hparams import ModelSpec, common_fields, layer_int
from mgserve.core.gguf.reader import GGUFError, GGUFFile

HYBRID_ARCHS = ("qwen3moe", "qwen3next", "qwen4exp")
_RECURRENT_ARCHS = ("qwen3next", "qwen4exp")  # Gated DeltaNet + gated full attention


@dataclass(frozen=True)
class HybridSpec:
    n_expert: int  # routed experts per layer
    n_expert_used: int  # top-k
    n_ff_exp: int  # hidden width of one routed expert
    n_ff_shexp: int  # hidden width of the shared expert; 0: none (qwen3moe)
    norm_topk: bool  # renormalise the top-k router weights to sum 1
    recurrent: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention (False)
    attn_gated: bool  # full attention q projection carries a sigmoid output gate (qwen3next)
    ssm_conv: int = 0  # causal conv kernel width (conv state keeps ssm_conv - 1 inputs)
    ssm_head_dim: int = 0  # DeltaNet key and value head dim (ssm.state_size)
    ssm_k_heads: int = 0  # ssm.group_count
    ssm_v_heads: int = 0  # ssm.time_step_rank

    def __post_init__(self) -> None:
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"expert_used_count {self.n_expert_used} not in 1..{self.n_expert}")
        if any(self.recurrent):
            if min(self.ssm_conv, self.ssm_head_dim, self.ssm_k_heads, self.ssm_v_heads) < 1:
                raise ValueError("recurrent layers need positive ssm.* hyperparameters")
            if self.ssm_v_heads % self.ssm_k_heads:
                raise ValueError(
                    f"ssm.time_step_rank {self.ssm_v_heads} is not a multiple of ssm.group_count "
                    f"{self.ssm_k_heads}"
                )

    @property
    def key_dim(self) -> int:  # q and k width of a DeltaNet layer
        return self.ssm_k_heads * self.ssm_head_dim

    @property
    def value_dim(self) -> int:  # v (and z) width of a DeltaNet layer
        return self.ssm_v_heads * self.ssm_head_dim

    @property
    def conv_dim(self) -> int:  # channels through the causal conv: [q | k | v]
        return 2 * self.key_dim + self.value_dim

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(il for il, r in enumerate(self.recurrent) if not r)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(il for il, r in enumerate(self.recurrent) if r)


def _recurrent_pattern(g: GGUFFile, arch: str, n_layer: int) -> tuple[bool, ...]:
    if arch not in _RECURRENT_ARCHS:
        return (False,) * n_layer
    explicit = g.get(f"{arch}.attention.recurrent_layers")
    if isinstance(explicit, bool | int):  # get_key_or_arr: a scalar applies to every layer
        return (bool(explicit),) * n_layer
    if explicit is not None:
        flags = tuple(bool(x) for x in explicit)[:n_layer]  # may list MTP layers past n_layer
        if len(flags) != n_layer:
            raise GGUFError(f"{g.path}: {arch}.attention.recurrent_layers has too few entries")
        return flags
    interval = int(g.get(f"{arch}.full_attention_interval", 4))
    if interval < 1:
        raise GGUFError(f"{g.path}: {arch}.full_attention_interval must be >= 1, got {interval}")
    return tuple((il + 1) % interval != 0 for il in range(n_layer))


def hybrid_spec_from_gguf(g: GGUFFile) -> tuple[ModelSpec, HybridSpec]:
    """The dense and the MoE/DeltaNet hyperparameters of a ``qwen3moe``/``qwen3next``/``qwen4exp``
    file."""
    arch = g.architecture
    if arch not in HYBRID_ARCHS:
        raise GGUFError(f"{g.path}: architecture {arch!r} is not one of {HYBRID_ARCHS}")

    def req(key: str) -> Any:
        return g.require(f"{arch}.{key}")

    def opt(key: str, default: Any) -> Any:
        return g.get(f"{arch}.{key}", default)

    fields = common_fields(g, arch)
    n_layer = fields["n_layer"]
    n_expert_used = layer_int(g, f"{arch}.expert_used_count", n_layer)
    n_ff = layer_int(g, f"{arch}.feed_forward_length", n_layer, 0)
    # llama.cpp: n_ff_exp = expert_feed_forward_length, else n_ff / n_expert_used; the shared
    # expert (always there in qwen3next / qwen4exp) is expert_shared_feed_forward_length wide,
    # else n_ff
    n_ff_exp = layer_int(
        g, f"{arch}.expert_feed_forward_length", n_layer, n_ff // max(n_expert_used, 1)
    )
    # qwen3moe has none: llama.cpp neither reads the key nor creates the tensors for it
    n_ff_shexp = int(opt("expert_shared_feed_forward_length", n_ff))
    try:
        hybrid = HybridSpec(
            n_expert=int(req("expert_count")),
            n_expert_used=n_expert_used,
            n_ff_exp=n_ff_exp,
            n_ff_shexp=n_ff_shexp if arch in _RECURRENT_ARCHS else 0,
            norm_topk=True,  # see the module docstring
            recurrent=_recurrent_pattern(g, arch, n_layer),
            attn_gated=arch in _RECURRENT_ARCHS,
            ssm_conv=int(opt("ssm.conv_kernel", 0)),
            ssm_head_dim=int(opt("ssm.state_size", 0)),
            ssm_k_heads=int(opt("ssm.group_count", 0)),
            ssm_v_heads=int(opt("ssm.time_step_rank", 0)),
        )
        inner = int(opt("ssm.inner_size", hybrid.value_dim))
        if inner != hybrid.value_dim:
            raise ValueError(f"ssm.inner_size {inner} != time_step_rank x state_size")
        if n_ff_exp < 1:
            raise ValueError("no expert_feed_forward_length (nor feed_forward_length)")
        spec = ModelSpec(**fields, n_ff=n_ff or n_ff_exp)
    except ValueError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{g.path}: inconsistent hyperparameters: {e}") from e
    return spec, hybrid


def dense_moe(spec: ModelSpec) -> HybridSpec | None:
    """The expert layout of a ``llama`` file with experts (Mixtral-style: every layer routes to
    ``n_expert`` experts of ``n_ff``, softmax top-k renormalised, no shared expert), else None."""
    if not spec.n_expert:
        return None
    return HybridSpec(
        n_expert=spec.n_expert,
        n_expert_used=spec.n_expert_used,
        n_ff_exp=spec.n_ff,
        n_ff_shexp=0,
        norm_topk=True,  # llama.cpp's llama graph passes norm_w = true
        recurrent=(False,) * spec.n_layer,
        attn_gated=False,
    )
