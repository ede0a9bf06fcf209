"""What every reference model shares: the embedding, the output head, and the batched ``forward``
skeleton over several sessions (token-wise work on all tokens at once, per-session work inside
each architecture's ``block``). ``MoeLM`` adds the MoE / DeltaNet hyperparameters that
qwen3moe, qwen3next and qwen4exp read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.base import SeqInput, check_inputs, flatten, logit_rows
from mgserve.core.models.kvcache import KVCache
from mgserve.core.models.tensors import load
from mgserve.core.reference import ops


class DecoderLM:
    """A decoder whose weights were dequantized to float32 at load (see dequant.py); subclasses
    define ``load_layer`` and ``block``."""

    rewindable = True  # attention only: a KV cache is rewritten from any position

    def __init__(self, g: GGUFFile, spec: ModelSpec) -> None:
        self.spec = spec
        self.tok_embd = load(g, "token_embd.weight", (spec.n_embd, spec.n_vocab))  # [V, d]
        self.output = (  # [V, d]
            self.tok_embd
            if spec.tied_output
            else load(g, "output.weight", (spec.n_embd, spec.n_vocab))
        )
        self.load_head(g)
        self.layers: list[Any] = [self.load_layer(g, il) for il in range(spec.n_layer)]

    def load_head(self, g: GGUFFile) -> None:
        """What ``head`` needs besides ``output``: here the final norm."""
        self.output_norm = load(g, "output_norm.weight", (self.spec.n_embd,))

    def load_layer(self, g: GGUFFile, il: int) -> Any:
        raise NotImplementedError

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache:
        return KVCache(self.spec, n_ctx, type_k, type_v)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream the first block reads: [N, d] (qwen4exp: [N, hc, d])."""
        return self.tok_embd[tokens]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of the residual rows x that want them."""
        return ops.linear(ops.rms_norm(x, self.output_norm, self.spec.rms_eps), self.output)

    def block(
        self, il: int, x: torch.Tensor, pos: torch.Tensor, seqs: Sequence[SeqInput]
    ) -> torch.Tensor:
        raise NotImplementedError

    def begin(self, seqs: Sequence[SeqInput]) -> None:
        """Validate per-session state before anything is written (default: nothing to check)."""

    def end(self, seqs: Sequence[SeqInput]) -> None:
        """Record that each session consumed its tokens (default: nothing to record)."""

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """[sum(n_logits), n_vocab] float32 logits, sessions in ``seqs`` order."""
        spec = self.spec
        check_inputs(seqs, spec.n_vocab)
        if not seqs:
            return torch.zeros(0, spec.n_vocab)
        self.begin(seqs)
        tokens, pos = flatten(seqs)  # [N], [N]
        x = self.embed(tokens)  # [N, d]
        for il in range(spec.n_layer):
            x = self.block(il, x, pos, seqs)
        self.end(seqs)
        return self.head(x[logit_rows(seqs)])  # [sum(n_logits), V]


class MoeLM(DecoderLM):
    """qwen3moe, qwen3next, qwen4exp: a decoder with the ``HybridSpec`` of its experts (and
    DeltaNet layers), which ``load_layer`` and ``block`` read."""

    def __init__(self, g: GGUFFile, spec: ModelSpec, hybrid: HybridSpec) -> None:
        self.hybrid = hybrid
        super().__init__(g, spec)
