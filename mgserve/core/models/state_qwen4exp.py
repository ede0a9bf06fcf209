"""Per-session state of ``qwen4exp``: everything a ``HybridState`` holds (K/V of the attention
layers, DeltaNet and conv states), plus

- the PLE layer's conv history (its last ``(kernel - 1) * ngram`` normalised inputs) and the last
  ``ngram - 1`` tokens the n-gram hash reads (EOS before the first token);
- per QSA layer, the keys of every complete indexer block (``blocks``, computed once when the block
  completes, so no step re-pools the context) and the raw keys of the incomplete one (``pending``).

``snapshot()`` copies what cannot be rewound by position: the recurrent and conv states, the
token history and ``pending`` (all small, independent of context length). ``blocks``, like K/V,
is indexed by position: entries of blocks that end at or before a restored ``pos`` are still
valid, later ones are rewritten before they are read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.hparams_qwen4exp import Qwen4ExpSpec
from mgserve.core.models.state import HybridState, Snapshot


class Qwen4ExpSnapshot(NamedTuple):
    base: Snapshot  # pos, DeltaNet conv and recurrent states
    ple_conv: torch.Tensor  # [(K - 1) * ngram, hc * d]
    ple_tokens: torch.Tensor  # [ngram - 1] int64, oldest first
    pending: torch.Tensor  # [n_qsa, r, D]


class Qwen4ExpState(HybridState):
    def __init__(
        self,
        spec: ModelSpec,
        hp: HybridSpec,
        qp: Qwen4ExpSpec,
        n_ctx: int,
        type_k: str,
        type_v: str,
    ) -> None:
        super().__init__(spec, hp, n_ctx, type_k, type_v)
        ple = qp.ple
        hist, back = (ple.history, ple.ngram - 1) if ple else (0, 0)
        self.ple_eos = ple.eos if ple else 0
        self.ple_conv = torch.zeros(hist, qp.hc * spec.n_embd)  # [(K - 1) * ngram, hc * d]
        self.ple_tokens = torch.full((back,), self.ple_eos, dtype=torch.int64)  # [ngram - 1]
        self.qsa_index = {il: i for i, il in enumerate(qp.qsa_layers)}
        r, n_qsa = max(qp.ratio, 1), len(qp.qsa_layers)
        self.blocks = torch.zeros(n_qsa, n_ctx // r, qp.idx_dim)  # [n_qsa, n_ctx / r, D]
        self.pending = torch.zeros(n_qsa, r, qp.idx_dim)  # [n_qsa, r, D] raw keys, pos % r

    def snapshot(self) -> Qwen4ExpSnapshot:  # type: ignore[override]
        return Qwen4ExpSnapshot(
            super().snapshot(), self.ple_conv.clone(), self.ple_tokens.clone(), self.pending.clone()
        )

    def restore(self, snap: Qwen4ExpSnapshot) -> None:  # type: ignore[override]
        """Go back to the state ``snap`` recorded (see the module docstring)."""
        if not isinstance(snap, Qwen4ExpSnapshot) or (
            snap.ple_conv.shape != self.ple_conv.shape
            or snap.ple_tokens.shape != self.ple_tokens.shape
            or snap.pending.shape != self.pending.shape
        ):
            raise ValueError("snapshot does not belong to a state of this model")
        super().restore(snap.base)  # validates the rest before anything is copied
        self.ple_conv.copy_(snap.ple_conv)
        self.ple_tokens.copy_(snap.ple_tokens)
        self.pending.copy_(snap.pending)

    def reset(self) -> None:
        super().reset()
        self.ple_conv.zero_()
        self.ple_tokens.fill_(self.ple_eos)
        self.pending.zero_()

    @property
    def nbytes(self) -> int:
        extra = self.ple_conv.nbytes + self.ple_tokens.nbytes + self.blocks.nbytes
        return super().nbytes + extra + self.pending.nbytes

    @property
    def recurrent_nbytes(self) -> int:
        extra = self.ple_conv.nbytes + self.ple_tokens.nbytes + self.pending.nbytes
        return super().recurrent_nbytes + extra
