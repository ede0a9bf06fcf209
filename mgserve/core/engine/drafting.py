"""What the scheduler asks of a speculator (``Drafter``): drafts for a decoding session's next
step, and what became of them. The n-gram speculator (mgserve/spec/) is one; the scheduler works
without any (``drafter=None``). The scheduler never drafts for a request under a grammar, nor
where a reasoning budget could force a token inside the run, nor past its ``max_tokens``, the
slot's context or ``draft_max``, and sends none when fewer than ``draft_min`` come
(speculation.py); the drafter decides everything else (its gates: sessions generating,
acceptance, measured cost)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mgserve.core.engine.contract import Request


class Drafter(Protocol):
    def start(self, req: Request, context: Sequence[int]) -> None:
        """``req`` begins in a slot whose context (what the model has seen or will see before
        its first sampled token) is ``context``: its prompt."""

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Tokens the session generated (in order), now part of its context."""

    def propose(
        self, request_id: str, n_generating: int, depth: int, limit: int
    ) -> tuple[int, ...]:
        """Drafts to verify after the session's last generated token (empty: none), at most
        ``limit``; ``n_generating`` sessions are past their prompts, this one is ``depth`` tokens
        deep."""

    def verified(self, request_id: str, n_draft: int, n_accepted: int) -> None:
        """Of ``n_draft`` drafts proposed for the session's last step, ``n_accepted`` held."""

    def observe_step(self, n_draft: int, depth: int, n_sessions: int, seconds: float) -> None:
        """A decode step of ``n_sessions`` sessions (the deepest ``depth`` tokens deep, at most
        ``n_draft`` drafts each; 0 for a plain step) took ``seconds``: the cost table's input."""

    def finish(self, request_id: str) -> None:
        """The request ended (any reason): forget its index."""


class GreedyOnly:
    """A drafter that drafts for greedy requests only: for the CPU reference runner, whose verify
    forward computes a session's 1 + k positions as one chunk, rounding them otherwise than plain
    decode does. A greedy token moves only at a near-tie of its top two logits; a sampled token
    moves whenever its draw falls near a boundary, which a long sampled answer meets. (The GPU
    runner's verify rows are plain decode's bits: it needs no such wrapper.)"""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.stats = getattr(inner, "stats", None)
        self._greedy: set[str] = set()

    def start(self, req: Request, context: Sequence[int]) -> None:
        if req.sampling.greedy:
            self._greedy.add(req.id)
        self.inner.start(req, context)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        self.inner.extend(request_id, tokens)

    def propose(
        self, request_id: str, n_generating: int, depth: int, limit: int
    ) -> tuple[int, ...]:
        if request_id not in self._greedy:
            return ()
        return self.inner.propose(request_id, n_generating, depth, limit)

    def verified(self, request_id: str, n_draft: int, n_accepted: int) -> None:
        self.inner.verified(request_id, n_draft, n_accepted)

    def observe_step(self, n_draft: int, depth: int, n_sessions: int, seconds: float) -> None:
        self.inner.observe_step(n_draft, depth, n_sessions, seconds)

    def finish(self, request_id: str) -> None:
        self._greedy.discard(request_id)
        self.inner.finish(request_id)
