"""The model interface the runner codes against: one batched ``forward`` over several sessions.

``forward`` takes one ``SeqInput`` per session. Token-wise work (projections, MLP) runs on all
sessions' tokens at once; attention runs per session against that session's own ``KVCache``. The
result does not depend on how a prompt is cut into chunks, nor on which sessions share the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.models.kvcache import KVCache


class SeqInput(NamedTuple):
    cache: KVCache  # the slot's state; positions [0, start) are already in it
    tokens: torch.Tensor  # [T] int64, T >= 1
    start: int  # position of tokens[0]
    n_logits: int  # return logits for the last n_logits positions (0: none)


class CausalLM(Protocol):
    spec: ModelSpec
    # True when a session's state can be cut back to any prefix of its history (an attention-only
    # KV cache); False for recurrent state, which only goes forward (or starts again at 0).
    rewindable: bool

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> KVCache: ...

    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """[sum(n_logits), n_vocab] float32 logits, sessions in ``seqs`` order."""
        ...


def check_inputs(seqs: Sequence[SeqInput], n_vocab: int) -> None:
    """ValueError for malformed inputs, before anything is written to a cache."""
    for i, s in enumerate(seqs):
        if s.tokens.dim() != 1 or s.tokens.numel() == 0:
            raise ValueError(f"sequence {i}: tokens must be a non-empty 1-D tensor")
        n = s.tokens.numel()
        if not 0 <= s.n_logits <= n:
            raise ValueError(f"sequence {i}: n_logits {s.n_logits} not in 0..{n}")
        if s.start < 0 or s.start + n > s.cache.n_ctx:
            raise ValueError(
                f"sequence {i}: positions {s.start}..{s.start + n - 1} exceed the context of "
                f"{s.cache.n_ctx} tokens"
            )
        lo, hi = int(s.tokens.min()), int(s.tokens.max())
        if lo < 0 or hi >= n_vocab:
            raise ValueError(f"sequence {i}: token id out of range 0..{n_vocab - 1}")


def flatten(seqs: Sequence[SeqInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """All sessions' tokens and their absolute positions, concatenated in ``seqs`` order."""
    tokens = torch.cat([s.tokens for s in seqs])  # [N]
    pos = torch.cat([s.start + torch.arange(s.tokens.numel()) for s in seqs])  # [N]
    return tokens, pos


def logit_rows(seqs: Sequence[SeqInput]) -> list[int]:
    """Indices, among the flattened tokens, of the positions whose logits are returned."""
    rows: list[int] = []
    end = 0
    for s in seqs:
        end += s.tokens.numel()
        rows.extend(range(end - s.n_logits, end))
    return rows
