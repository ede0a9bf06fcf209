"""The n-gram speculator: the scheduler's ``Drafter`` (core/engine/drafting.py) from a fresh
``NgramIndex`` per request and one ``SpecGate`` for all, with its ``SpecStats``.

A request's index is made when it starts and dropped when it finishes, so nothing one request
saw reaches another. A request with ``speculative`` False gets no index and never drafts. Its
``draft_max`` (else the server's ``--spec-k``, and never more) bounds a step's drafts, and
``draft_min`` (at most the maximum) is llama-server's ``speculative.n_min``: fewer drafts than
that are not worth a verify, so none are proposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mgserve.config import Settings
from mgserve.core.engine.contract import Request
from mgserve.spec.gate import SpecGate
from mgserve.spec.ngram import NgramIndex
from mgserve.spec.stats import SpecStats


@dataclass
class _Session:
    index: NgramIndex
    draft_max: int
    draft_min: int


class Speculator:
    """Drafts from each session's own tokens, where the gate says they pay."""

    def __init__(
        self,
        gate: SpecGate | None = None,
        k_max: int = 16,
        ngram_min: int = 2,
        ngram_max: int = 8,
        stats: SpecStats | None = None,
    ) -> None:
        NgramIndex(ngram_min, ngram_max)  # the key lengths checked once, here
        self.gate = gate or SpecGate()
        self.k_max = k_max
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.stats = stats or SpecStats()
        self._sessions: dict[str, _Session] = {}

    def start(self, req: Request, context: Sequence[int]) -> None:
        if not req.speculative:
            return
        draft_max = self.k_max if req.draft_max is None else min(req.draft_max, self.k_max)
        index = NgramIndex(self.ngram_min, self.ngram_max)
        index.extend(context)
        self._sessions[req.id] = _Session(index, draft_max, min(req.draft_min, draft_max))
        self.gate.start(req.id)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        s = self._sessions.get(request_id)
        if s is not None:
            s.index.extend(tokens)

    def propose(
        self, request_id: str, n_generating: int, depth: int, limit: int
    ) -> tuple[int, ...]:
        s = self._sessions.get(request_id)
        if s is None:
            return ()
        k = self.gate.draft_length(
            request_id, n_generating, depth, min(limit, s.draft_max), s.draft_min
        )
        if k == 0:
            return ()
        drafts = s.index.propose(k)
        return drafts if len(drafts) >= max(1, s.draft_min) else ()

    def verified(self, request_id: str, n_draft: int, n_accepted: int) -> None:
        self.gate.verified(request_id, n_draft, n_accepted)
        self.stats.on_verified(request_id, n_draft, n_accepted)

    def observe_step(self, n_draft: int, depth: int, n_sessions: int, seconds: float) -> None:
        self.gate.observe_step(n_draft, depth, n_sessions, seconds)
        self.stats.on_step(n_draft)

    def finish(self, request_id: str) -> None:
        self._sessions.pop(request_id, None)
        self.gate.finish(request_id)
        self.stats.on_finish(request_id)


def speculator_from(settings: Settings) -> Speculator | None:
    """The server's speculator (None: ``--spec off`` or ``--spec-k 0``)."""
    if settings.spec == "off" or settings.spec_k == 0:
        return None
    gate = SpecGate(max_users=settings.spec_max_users, min_acceptance=settings.spec_min_acceptance)
    return Speculator(gate, settings.spec_k, settings.spec_ngram_min, settings.spec_ngram_max)
