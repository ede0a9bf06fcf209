"""Tiny random Qwen3MoeForCausalLM / Qwen3NextForCausalLM and their GGUF (F32) exports, for tests.

The exporter follows llama.cpp's converter (conversion/qwen.py ``Qwen2MoeModel``,
``Qwen3MoeModel``, ``Qwen3NextModel``):
- experts: HF's fused ``gate_up_proj`` [E, 2 ff, d] is split into ``ffn_gate_exps`` and
  ``ffn_up_exps`` (or kept fused as ``ffn_gate_up_exps``, gate rows first, with ``fused=True``);
- qwen3next: every ``*norm.weight`` but the DeltaNet's gated ``linear_attn.norm`` is stored 1 + w
  (HF's RMSNorm there is zero-centred); ``A_log`` becomes ``ssm_a = -exp(A_log)``; ``dt_bias``
  becomes ``ssm_dt.bias``; ``conv1d`` [C, 1, K] is squeezed to [C, K]; ``in_proj_qkvz``, laid out
  per key head as [q | k | v_group | z_group], is regrouped into ``attn_qkv`` = [all q | all k |
  all v] and ``attn_gate`` = z; ``in_proj_ba`` is stored as is (``ssm_ba``); the shared-expert gate
  keeps its [1, d] shape (GGUF [d, 1]); ``attention.recurrent_layers`` lists the DeltaNet layers
  (beside ``full_attention_interval``), as the converter writes both.
A synthetic byte-level BPE vocabulary (mgserve.core.synth.vocab) makes the files loadable by
llama.cpp; mgserve ignores it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mgserve.core.gguf.writer import GGUFWriter
from mgserve.core.synth.vocab import SynthVocab
from tests.core.tiny import attention_metadata
from tests.hf_version import pinned_transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = SynthVocab(320, "qwen2", endoftext_id=317, im_start_id=318, im_end_id=319)
ARCHS = ("qwen3moe", "qwen3next")


def hf_model(arch: str, seed: int = 0) -> Any:
    """A small random causal LM of ``arch`` (8 experts, top-2), eval mode, eager, float32."""
    tf = pinned_transformers()

    common: dict[str, Any] = dict(
        vocab_size=VOCAB.n_vocab,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # llama.cpp always renormalises for these archs
        tie_word_embeddings=False,
    )
    if arch == "qwen3moe":
        common |= dict(head_dim=32)
        cfg: Any = tf.Qwen3MoeConfig(
            num_hidden_layers=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
        cls: Any = tf.Qwen3MoeForCausalLM
    elif arch == "qwen3next":
        # 8 layers: 3, 7 full attention, the rest Gated DeltaNet; 2 key heads serve 4 value heads
        common |= dict(full_attention_interval=4)  # __post_init__ turns it into layer_types
        cfg = tf.Qwen3NextConfig(
            num_hidden_layers=8,
            head_dim=64,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=96,
            **common,
        )
        cls = tf.Qwen3NextForCausalLM
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # shake every parameter (norms, router, decays) off its init value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _qkvz(w: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz [per key head: q | k | v_g | z_g] rows -> (attn_qkv, attn_gate) rows."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    vg = hv // hk * dv
    per_head = w.view(hk, 2 * dk + 2 * vg, -1)  # [H_k, rows per key head, d]
    q, k, v, z = torch.split(per_head, [dk, dk, vg, vg], dim=1)
    flat = [x.reshape(-1, w.shape[1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def gguf_tensors(arch: str, model: Any, fused: bool = False) -> dict[str, torch.Tensor]:
    """llama.cpp tensor names -> float32 tensors in torch order ([out, in])."""
    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    shift = 1.0 if arch == "qwen3next" else 0.0
    out: dict[str, torch.Tensor] = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"] + shift,
        "output.weight": sd["lm_head.weight"],
    }
    simple = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
        "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.dt_bias": "ssm_dt.bias",
        "post_attention_layernorm.weight": (
            "post_attention_norm.weight" if arch == "qwen3next" else "ffn_norm.weight"
        ),
    }
    for key, value in sd.items():
        if not key.startswith("model.layers."):
            continue
        il, rest = key.removeprefix("model.layers.").split(".", 1)
        p = f"blk.{il}."
        if rest == "mlp.experts.gate_up_proj":
            if fused:
                out[p + "ffn_gate_up_exps.weight"] = value
            else:
                ff = value.shape[1] // 2
                out[p + "ffn_gate_exps.weight"] = value[:, :ff]
                out[p + "ffn_up_exps.weight"] = value[:, ff:]
        elif rest == "linear_attn.in_proj_qkvz.weight":
            out[p + "attn_qkv.weight"], out[p + "attn_gate.weight"] = _qkvz(value, cfg)
        elif rest == "linear_attn.conv1d.weight":
            out[p + "ssm_conv1d.weight"] = value.squeeze(1)
        elif rest == "linear_attn.A_log":
            out[p + "ssm_a"] = -torch.exp(value)
        else:
            if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
                value = value + shift
            out[p + simple[rest]] = value
    return {k: v.contiguous() for k, v in out.items()}


def metadata(arch: str, cfg: Any) -> dict[str, Any]:
    """The keys convert_hf_to_gguf.py writes for ``arch`` (integers as UINT32, floats FLOAT32)."""
    md: dict[str, Any] = attention_metadata(cfg) | {
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "expert_count": cfg.num_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
    }
    if arch == "qwen3next":
        factor = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
        md |= {
            "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
            "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
            "ssm.state_size": cfg.linear_key_head_dim,
            "ssm.group_count": cfg.linear_num_key_heads,
            "ssm.time_step_rank": cfg.linear_num_value_heads,
            "ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
            "attention.recurrent_layers": [t == "linear_attention" for t in cfg.layer_types],
            "full_attention_interval": cfg.layer_types.index("full_attention") + 1,
            "rope.dimension_count": int(cfg.head_dim * factor),
        }
    return md


def export(
    model: Any,
    arch: str,
    path: Path,
    fused: bool = False,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    """The tiny HF ``model`` as an F32 GGUF file at ``path``; ``edit`` may damage the tensors."""
    from gguf.constants import GGMLQuantizationType, GGUFValueType

    tensors = {k: v.numpy().astype(np.float32) for k, v in gguf_tensors(arch, model, fused).items()}
    if edit is not None:
        edit(tensors)
    with GGUFWriter(path, arch) as w:
        w.add("general.name", f"tiny {arch}")
        w.add("general.file_type", 0, GGUFValueType.UINT32)
        for key, value in metadata(arch, model.config).items():
            vtype = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
            if isinstance(value, list) and isinstance(value[0], bool):
                vtype = GGUFValueType.BOOL
            w.add(f"{arch}.{key}", value, vtype)
        for key, (value, explicit) in VOCAB.metadata().items():
            w.add(key, value, explicit)
        for name, arr in tensors.items():
            w.add_tensor_info(name, tuple(reversed(arr.shape)), GGMLQuantizationType.F32)
        w.write_header()
        for name, arr in tensors.items():
            w.write_tensor_data(name, arr)
    return path


def prompt_tokens(n: int, seed: int = 1) -> torch.Tensor:
    """[n] int64 random ordinary token ids (no control tokens)."""
    return torch.randint(0, VOCAB.endoftext_id, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: Any, tokens: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """[len(tokens), V] HF logits: ``n_prefill`` tokens in one call, then one token per call
    through HF's cache (DeltaNet: chunked kernel for the prefill, recurrent kernel per step)."""
    with torch.no_grad():
        out = model(tokens[None, :n_prefill], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[0]]
        for t in range(n_prefill, tokens.numel()):
            out = model(tokens[None, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0])
    return torch.cat(logits).float()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the error relative to the logits' scale."""
    return float((got - want).abs().max() / want.abs().max())


def run_chunks(
    lm: Any, cache: Any, tokens: torch.Tensor, chunk: int, start: int = 0
) -> torch.Tensor:
    """Feed ``tokens`` to one session ``chunk`` at a time from ``start``; all logits [T, V]."""
    from mgserve.core.models.base import SeqInput

    out = []
    for c in range(0, tokens.numel(), chunk):
        part = tokens[c : c + chunk]
        out.append(lm.forward([SeqInput(cache, part, start + c, part.numel())]))
    return torch.cat(out)


def batched_and_alone(
    lm: Any,
    new_state: Callable[[Any], Any],
    tokens: torch.Tensor,
    starts: tuple[int, ...],
    sizes: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
    """One session per start (prefilled to it), then each session's next ``size`` tokens in ONE
    forward call and again alone on a copy of its state: (together, alone, states, copies)."""
    from mgserve.core.models.base import SeqInput

    states = [new_state(lm) for _ in starts]
    for n, st in zip(starts, states, strict=True):
        if n:
            run_chunks(lm, st, tokens[:n], 64)
    forks = [st.copy() for st in states]
    seqs = [
        SeqInput(st, tokens[n : n + t], n, min(t, 2))
        for st, n, t in zip(states, starts, sizes, strict=True)
    ]
    together = lm.forward(seqs)
    alone = torch.cat([lm.forward([s._replace(cache=f)]) for s, f in zip(seqs, forks, strict=True)])
    return together, alone, states, forks


def load_reference(arch: str) -> dict[str, Any]:
    """The entry for ``arch`` in tests/data/hybrid_llama_reference.json."""
    import json

    path = Path(__file__).resolve().parents[1] / "data" / "hybrid_llama_reference.json"
    return json.loads(path.read_text())[arch]


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def require_reference_file(path: Path, ref: dict[str, Any], maker: str) -> None:
    """Skip a comparison with a recorded llama.cpp reference when the tiny model exported here is
    not the file it was recorded on: transformers' random initialisation goes through torch's
    vectorised math, whose last bits differ between CPU instruction sets (AVX2 vs AVX-512), so
    the same seed gives another file on another kind of CPU. Rerun ``maker`` to compare here."""
    import pytest

    if file_sha256(path) != ref["gguf_sha256"]:
        pytest.skip(
            f"the tiny model exported on this CPU is not the file the llama.cpp reference "
            f"was recorded on (random init differs by instruction set); rerun {maker}"
        )


def write_synth_qwen3next(path: Path) -> Path:
    """A tiny qwen3next in the real files' layout and quant mix (Q4_K, Q6_K, Q8_0 ssm_ba, F32
    norms and 1-D shared-expert gate), random weights, by ``mgserve synth``'s writer."""
    import dataclasses

    from mgserve.core.synth.shapes import QWEN3NEXT_80B_A3B
    from mgserve.core.synth.write import write_synth

    spec = dataclasses.replace(
        QWEN3NEXT_80B_A3B,
        name="tiny qwen3next (synthetic, quantized)",
        n_layer=4,
        n_embd=256,  # K-quants need rows that are multiples of 256
        n_ctx=512,
        vocab=SynthVocab(512, "qwen2", endoftext_id=509, im_start_id=510, im_end_id=511),
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_rot=16,
        ssm_k_heads=2,
        ssm_v_heads=4,
        ssm_head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff_shexp=256,
    )
    # the mix the recorded llama.cpp reference (and its gguf_sha256) was made with
    return write_synth(spec, path, seed=1, mix="ud-q4_k_xl").path
