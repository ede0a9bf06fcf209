"""Gemma 3 on the reference ops: ``Llama`` with Gemma's block.

Differences from llama (llama.cpp src/models/gemma3.cpp): the embedding is scaled by sqrt(n_embd);
q and k are RMS-normalized per head; attention and MLP outputs are RMS-normalized again before the
residual add (post-norms); the MLP is GeGLU with tanh GELU; 5 of every 6 layers use a sliding window
and RoPE base 10000 (see gguf/hparams.py). The "1 + w" of Gemma's norms is folded into the GGUF
weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mgserve.core.models.base import SeqInput
from mgserve.core.models.llama import Layer, Llama
from mgserve.core.reference import ops


class Gemma3(Llama):
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embd[tokens] * math.sqrt(self.spec.n_embd)

    def block(
        self, il: int, x: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:
        layer: Layer = self.layers[il]
        eps = self.spec.rms_eps
        assert layer.post_attn_norm is not None and layer.post_ffn_norm is not None
        assert layer.gate is not None and layer.up is not None and layer.down is not None
        a = self.attend(il, layer, ops.rms_norm(x, layer.attn_norm, eps), pos, seqs)
        x = x + ops.rms_norm(a, layer.post_attn_norm, eps)
        h = ops.rms_norm(x, layer.ffn_norm, eps)
        m = ops.linear(ops.geglu(ops.linear(h, layer.gate), ops.linear(h, layer.up)), layer.down)
        return x + ops.rms_norm(m, layer.post_ffn_norm, eps)
