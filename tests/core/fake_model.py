"""A tiny deterministic ``CausalLM`` for engine and runner tests: no weights, exact, fast.

Its "KV cache" stores a rolling hash of the tokens at each position; the logits at a position are
pseudo-random numbers seeded by that hash. So the logits depend on the whole context and nothing
else, exactly like a real model: a wrong ``start``, a stale cache or a mixed-up slot changes the
output, while chunking and batch composition do not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mgserve.core.models.base import SeqInput

_MOD = (1 << 61) - 1


def _mix(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) % _MOD


@dataclass(frozen=True)
class FakeSpec:
    n_vocab: int = 64
    n_ctx_train: int = 256
    arch: str = "fake"  # what slot files record (slot_store.py)


class FakeCache:
    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.hashes: list[int] = []  # rolling hash of tokens[0..i], per position i


class FakeModel:
    rewindable = True

    def __init__(self, n_vocab: int = 64, n_ctx_train: int = 256, delay: float = 0.0) -> None:
        self.spec = FakeSpec(n_vocab, n_ctx_train)
        self.delay = delay  # seconds per forward, so steps overlap with submits in engine tests
        self.calls: list[list[tuple[int, int, int]]] = []  # per forward: (start, T, n_logits)
        self.fail_token: int | None = None  # forward raises if this token id is fed

    def new_cache(self, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> FakeCache:
        return FakeCache(n_ctx)

    def logits_at(self, h: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(h % (1 << 62))
        return torch.randn(self.spec.n_vocab, generator=g) * 3.0  # [V]

    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        self.calls.append([(s.start, s.tokens.numel(), s.n_logits) for s in seqs])
        if self.delay:
            time.sleep(self.delay)
        for s in seqs:
            if self.fail_token is not None and self.fail_token in s.tokens.tolist():
                raise RuntimeError("fake failure")
        rows: list[torch.Tensor] = []
        for s in seqs:
            c: FakeCache = s.cache  # type: ignore[assignment]
            assert len(c.hashes) >= s.start, "the cache must hold positions [0, start)"
            if s.start + s.tokens.numel() > c.n_ctx:
                raise ValueError("past the context end")
            del c.hashes[s.start :]
            h = c.hashes[-1] if c.hashes else 1
            for t in s.tokens.tolist():
                h = _mix(h, t)
                c.hashes.append(h)
            if s.n_logits:
                rows.extend(self.logits_at(x) for x in c.hashes[-s.n_logits :])
        if not rows:
            return torch.zeros(0, self.spec.n_vocab)
        return torch.stack(rows)  # [sum(n_logits), V]

    @staticmethod
    def context_hash(tokens: list[int]) -> int:
        h = 1
        for t in tokens:
            h = _mix(h, t)
        return h

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """What greedy decoding must give: computed from scratch, no cache or scheduler involved."""
        h = self.context_hash(prompt)
        out: list[int] = []
        for _ in range(n):
            t = int(torch.argmax(self.logits_at(h)))
            out.append(t)
            h = _mix(h, t)
        return out
