"""Tiny random Hugging Face models and their GGUF (F32) exports, for tests.

The exporter follows llama.cpp's convert_hf_to_gguf.py (conversion/llama.py, conversion/gemma.py):
llama's Q/K rows are permuted so ggml's pair-wise RoPE equals HF's rotate-half, and Gemma's norm
weights are stored as 1 + w. Only what mgserve's loader reads is written (no tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB = 160
SLIDING_WINDOW = 8


def hf_model(arch: str, seed: int = 0, tied: bool = False) -> Any:
    """A small random causal LM of ``arch``, eval mode, eager attention, float32."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    if arch == "gemma3":
        # 7 layers: the 6th (index 5) is global, the others slide over 8 tokens
        cfg: Any = tf.Gemma3TextConfig(
            num_hidden_layers=7, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=32, **common
        )
        cls: Any = tf.Gemma3ForCausalLM
    else:
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        cfg, cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        }[arch]
        cfg = cfg(num_hidden_layers=2, **common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # shake every parameter (norms and biases included) off its init value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> consecutive pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(arch: str, model: Any) -> dict[str, np.ndarray]:
    """llama.cpp tensor names -> float32 arrays in torch order ([out, in])."""
    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    norm_shift = 1.0 if arch == "gemma3" else 0.0
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    if arch == "gemma3":
        names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    out: dict[str, torch.Tensor] = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"] + norm_shift,
    }
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for key, value in sd.items():
        if not key.startswith("model.layers."):
            continue
        il, rest = key.removeprefix("model.layers.").split(".", 1)
        stem, kind = rest.rsplit(".", 1)
        if arch == "llama" and stem == "self_attn.q_proj":
            value = _permute(value, cfg.num_attention_heads)
        if arch == "llama" and stem == "self_attn.k_proj":
            value = _permute(value, cfg.num_key_value_heads)
        if stem.endswith("norm"):
            value = value + norm_shift
        out[f"blk.{il}.{names[stem]}.{kind}"] = value
    return {k: v.contiguous().numpy().astype(np.float32) for k, v in out.items()}


def attention_metadata(cfg: Any) -> dict[str, Any]:
    """The ``{arch}.*`` keys convert_hf_to_gguf.py writes for any decoder's blocks and attention
    (integers are written as UINT32, floats as FLOAT32)."""
    return {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }


def write_gguf(
    path: Path,
    arch: str,
    cfg: Any,
    tensors: dict[str, np.ndarray],
    drop_keys: tuple[str, ...] = (),
) -> Path:
    """Write hyperparameters as convert_hf_to_gguf does and ``tensors`` as F32."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    kv = attention_metadata(cfg)
    if arch == "gemma3":
        kv["rope.freq_base"] = float(cfg.rope_parameters["full_attention"]["rope_theta"])
        kv["rope.freq_base_swa"] = float(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        kv["attention.sliding_window"] = cfg.sliding_window
    else:
        kv["rope.freq_base"] = float(cfg.rope_parameters["rope_theta"])
    w.add_name(f"tiny {arch}")
    for key, value in kv.items():
        if key in drop_keys:
            continue
        vtype = (
            gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        )
        w.add_key_value(f"{arch}.{key}", value, vtype)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def export(model: Any, arch: str, path: Path) -> Path:
    """The tiny HF ``model`` as a GGUF file at ``path``."""
    return write_gguf(path, arch, model.config, gguf_tensors(arch, model))
