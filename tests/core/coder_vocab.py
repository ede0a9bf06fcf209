"""Qwen2.5-Coder's vocabulary as its GGUF files carry it, and a tiny random qwen2 model using it.

Qwen2.5 keeps Qwen2's byte-level BPE (tokens, merges: llama.cpp's ggml-vocab-qwen2.gguf, kept in
tests/data/llama_vocab) and adds 22 tokens after it, the FIM ones among them. llama.cpp's converter
(conversion/base.py ``get_vocab_base``) writes an added token as control when the tokenizer marks
it special or its text looks special (``<|...|>``), else as user-defined (``<tool_call>``), and
every id past the tokenizer's up to ``vocab_size`` as ``[PAD{i}]``, unused. It writes no
``fim_*_token_id`` key: llama.cpp finds the FIM tokens by their text.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType

from mgserve.core.gguf.writer import GGUFWriter
from tests.core.test_tokenizer_llama_vectors import metadata

N_VOCAB = 151936  # Qwen2.5-Coder-1.5B's config.json vocab_size (the embedding's rows)
ENDOFTEXT = 151643
ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
FIM_PRE, FIM_MID, FIM_SUF, FIM_PAD, REPO_NAME, FILE_SEP = range(151659, 151665)
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5


@cache
def _coder_metadata() -> dict[str, Any]:
    meta = dict(metadata("qwen2"))
    tokens = list(meta["tokenizer.ggml.tokens"][:ENDOFTEXT])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"][:ENDOFTEXT]]
    for text in ADDED:
        tokens.append(text)
        types.append(CONTROL if text.startswith("<|") and text.endswith("|>") else USER_DEFINED)
    for i in range(len(tokens), N_VOCAB):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
    meta.update(
        {
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.add_bos_token": False,
            "general.name": "Qwen2.5 Coder 1.5B",
        }
    )
    return meta


def coder_metadata() -> dict[str, Any]:
    """Qwen2.5-Coder-1.5B's ``tokenizer.*`` metadata (a fresh dict each call)."""
    return dict(_coder_metadata())


# a 2-block qwen2 at tests/core/tiny.py's sizes: [out, in] shapes in torch order
_KV = {
    "context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 96,
    "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
    "attention.value_length": 32, "attention.layer_norm_rms_epsilon": 1e-5,
    "rope.freq_base": 10000.0,
}  # fmt: skip
_BLOCK = {
    "attn_norm.weight": (64,), "attn_q.weight": (128, 64), "attn_q.bias": (128,),
    "attn_k.weight": (64, 64), "attn_k.bias": (64,), "attn_v.weight": (64, 64),
    "attn_v.bias": (64,), "attn_output.weight": (64, 128), "ffn_norm.weight": (64,),
    "ffn_gate.weight": (96, 64), "ffn_up.weight": (96, 64), "ffn_down.weight": (64, 96),
}  # fmt: skip


def tiny_coder(path: Path, seed: int = 0) -> Path:
    """A tiny random qwen2 model with Qwen2.5-Coder's vocabulary (F32, tied embeddings) at
    ``path``; the text it writes is noise."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (N_VOCAB, 64), "output_norm.weight": (64,)}
    for il in range(2):
        shapes |= {f"blk.{il}.{name}": shape for name, shape in _BLOCK.items()}
    tensors = {
        name: (1.0 if name.endswith("norm.weight") else 0.0)
        + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        for name, shape in shapes.items()
    }
    with GGUFWriter(path, "qwen2") as w:
        w.add("general.name", "tiny qwen2 coder")
        for key, value in _KV.items():
            vtype = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
            w.add(f"qwen2.{key}", value, vtype)
        for key, value in coder_metadata().items():
            if key.startswith("tokenizer."):
                w.add(key, value, GGUFValueType.UINT32 if key.endswith("_id") else None)
        for name, arr in tensors.items():
            w.add_tensor_info(name, tuple(reversed(arr.shape)), GGMLQuantizationType.F32)
        w.write_header()
        for name, arr in tensors.items():
            w.write_tensor_data(name, arr.astype(np.float32))
    return path
