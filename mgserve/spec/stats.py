"""Speculation's counters (``SpecStats``): drafts proposed and accepted, acceptance by draft
position, drafting steps and the tokens they emitted; /metrics shows them (core/engine/metrics.py).

Drafts are counted when the scheduler reports them verified, so proposed and accepted describe the
same drafts. Position i (from 0) was proposed when a step carried more than i drafts, and accepted
when the first i + 1 drafts all held. Per slot: the speculator sees request ids, not slots, so the
counts are kept per open request (``by_request``) and summed over all; not by slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestSpec:
    """One open request's drafts."""

    proposed: int = 0
    accepted: int = 0


@dataclass
class SpecStats:
    proposed: int = 0  # drafts verified
    accepted: int = 0  # of them, those that held
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    verifies: int = 0  # session steps that carried drafts
    emitted: int = 0  # tokens those session steps gave: 1 + the drafts that held, each
    steps: int = 0  # runner steps that carried drafts (any session)
    by_request: dict[str, RequestSpec] = field(default_factory=dict)

    def on_verified(self, request_id: str, n_draft: int, n_accepted: int) -> None:
        if n_draft <= 0:
            return
        assert 0 <= n_accepted <= n_draft, (n_draft, n_accepted)
        self.proposed += n_draft
        self.accepted += n_accepted
        _add_prefix(self.proposed_by_position, n_draft)
        _add_prefix(self.accepted_by_position, n_accepted)
        self.verifies += 1
        self.emitted += 1 + n_accepted
        mine = self.by_request.setdefault(request_id, RequestSpec())
        mine.proposed += n_draft
        mine.accepted += n_accepted

    def on_step(self, n_draft: int) -> None:
        self.steps += n_draft > 0

    def on_finish(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a session's drafting step emitted (1.0: no draft ever held)."""
        return self.emitted / self.verifies if self.verifies else 0.0


def _add_prefix(counts: list[int], n: int) -> None:
    """One more at each of positions 0 .. n - 1."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1
