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
