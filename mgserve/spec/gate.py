"""How many drafts a session's next step should carry (0: none): speculation only where it pays.

Three gates, in order:

1. Users: none while more than ``max_users`` sessions are generating. A batch of many sessions
   is already compute-bound on a GPU, and a verify row per draft then costs as much as a token.
2. Cost: a table of measured step seconds, kept online from ``observe_step``, by (depth bucket:
   the deepest session's depth rounded down to a power of two; sessions in the step; draft bucket:
   the drafts per session rounded down to a power of two, 0 for a plain step). The draft length k
   is the candidate (0, powers of two up to the limit, the limit) with the most expected tokens
   per second, E[emitted | a, k] / cost(k), where a is the session's per-draft acceptance and
   E[emitted] = sum_{i=0..k} a^i (each draft holds with probability a once the ones before it
   did, and the model's own token follows the last that held). cost(0) is the plain step at this
   depth bucket (the nearest measured one otherwise); cost(k) = cost(0) * (1 + slope * k), the
   slope (a draft's share of a plain step) from the nearest measured draft bucket at the nearest
   depth bucket that has one, else ``COST_SLOPE`` (the prior before anything is measured: a GPU
   decode step is bound by reading the weights, so a few more rows cost little; a CPU step is
   not, and its first measurements say so). Before any plain step of this many sessions has been
   measured, the answer is 0, so one is. A cell's estimate is the median of its last few steps.
3. Acceptance: a per-session running acceptance, an exponentially decayed ratio of accepted
   drafts to drafts that were tried (a draft after a rejected one was never tried), starting
   optimistic. Below ``min_acceptance``, or where the cost table's choice at this acceptance is 0
   though at full acceptance it would not be, the session drafts nothing but a probe of
   ``probe_k`` drafts after ``probe_every`` steps without any, so it can recover when the text
   turns repetitive; each probe that misses doubles the wait for the next (up to ``MAX_WAIT``),
   so prose pays ever less for them. Where even full acceptance would not pay, there is no probe.

Pure and deterministic: no clock, no randomness; the scheduler's numbers are its only input.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

COST_SLOPE = 0.02  # prior: each draft adds 2% of a plain step, until measured
SAMPLES = 5  # step times a cost table cell keeps (its estimate is their median)


MAX_WAIT = 256  # the longest a held-back session waits between probes, in steps


class _Cell:
    """A cost table cell: its recent steps' seconds and drafts per session. The first step of
    each kind is a warm-up (a graph captured, a kernel compiled) and is not kept; a median
    ignores a lone slow step (a collection pause), which would otherwise close a gate for good."""

    def __init__(self) -> None:
        self.warm = False
        self.samples: deque[tuple[float, int]] = deque(maxlen=SAMPLES)
        self.seconds = 0.0  # the median of the samples (0.0 while there are none)
        self.drafts = 0.0  # their mean drafts per session

    def add(self, seconds: float, n_draft: int) -> None:
        if self.warm:
            self.samples.append((seconds, n_draft))
            self.seconds = statistics.median(s for s, _ in self.samples)
            self.drafts = sum(d for _, d in self.samples) / len(self.samples)
        self.warm = True


@dataclass
class _Session:
    accepted: float  # decayed drafts that held
    tried: float  # decayed drafts that were checked: those that held, and the first that did not
    idle: int = 0  # steps held back by the acceptance gate since the last verified drafts
    wait: int = 0  # steps to hold back before the next probe (0: probe_every); doubles on a miss


class SpecGate:
    """The draft length per step; one for all sessions (one cost table), state per session."""

    def __init__(
        self,
        max_users: int = 2,
        min_acceptance: float = 0.2,
        probe_every: int = 16,
        probe_k: int = 4,
        prior_acceptance: float = 0.8,
        prior_weight: float = 2.0,
        decay: float = 0.9,
    ) -> None:
        self.max_users = max_users
        self.min_acceptance = min_acceptance
        self.probe_every = probe_every
        self.probe_k = probe_k
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = decay
        self._sessions: dict[str, _Session] = {}
        # (depth bucket, sessions) -> draft bucket -> cell
        self._cells: dict[tuple[int, int], dict[int, _Cell]] = {}

    # -- sessions --------------------------------------------------------------------------------

    def start(self, request_id: str) -> None:
        w = self.prior_weight
        self._sessions[request_id] = _Session(self.prior_acceptance * w, w)

    def finish(self, request_id: str) -> None:
        self._sessions.pop(request_id, None)

    def acceptance(self, request_id: str) -> float:
        """The session's running per-draft acceptance."""
        s = self._sessions[request_id]
        return s.accepted / s.tried if s.tried > 0 else 0.0

    def verified(self, request_id: str, n_draft: int, n_accepted: int) -> None:
        """Of ``n_draft`` drafts, the first ``n_accepted`` held."""
        s = self._sessions.get(request_id)
        if s is None or n_draft <= 0:
            return
        s.accepted = self.decay * s.accepted + n_accepted
        s.tried = self.decay * s.tried + n_accepted + (n_accepted < n_draft)
        if s.idle:  # a probe: held back, wait twice as long for the next (text that never
            # repeats costs ever fewer probes: 16, 32, ... steps apart, at most MAX_WAIT)
            missed = self.acceptance(request_id) < self.min_acceptance
            s.wait = min(2 * (s.wait or self.probe_every), MAX_WAIT) if missed else 0
        s.idle = 0

    # -- the decision ----------------------------------------------------------------------------

    def draft_length(
        self, request_id: str, n_generating: int, depth: int, limit: int, draft_min: int = 0
    ) -> int:
        """Drafts to ask for in the session's next step: 0, or in [max(1, draft_min), limit]."""
        s = self._sessions.get(request_id)
        if s is None or limit < max(1, draft_min) or n_generating > self.max_users:
            return 0
        db = depth.bit_length()
        c0 = self._plain_cost(db, n_generating)
        if c0 is None:
            return 0  # measure a plain step of this many sessions first
        slopes = self._slopes(db, n_generating, c0)
        costs = [(k, _cost(slopes, k, c0)) for k in _candidates(limit)]
        if _best(1.0, c0, costs) == 0:
            return 0  # verifying costs more than even accepted drafts save
        a = self.acceptance(request_id)
        k = _best(a, c0, costs) if a >= self.min_acceptance else 0
        if k == 0:
            s.idle += 1
            if s.idle < (s.wait or self.probe_every):
                return 0
            k = min(self.probe_k, limit)
        return max(k, draft_min)

    # -- the cost table --------------------------------------------------------------------------

    def observe_step(self, n_draft: int, depth: int, n_sessions: int, seconds: float) -> None:
        """A decode step of ``n_sessions`` sessions, the deepest ``depth`` tokens deep, at most
        ``n_draft`` drafts each, took ``seconds``."""
        if n_sessions <= 0 or seconds <= 0:
            return
        cells = self._cells.setdefault((depth.bit_length(), n_sessions), {})
        cells.setdefault(n_draft.bit_length(), _Cell()).add(seconds, n_draft)

    def cost(self, k: int, db: int, n_sessions: int, c0: float) -> float:
        """Estimated seconds of a step with ``k`` drafts per session at depth bucket ``db``,
        whose plain step costs ``c0``."""
        return _cost(self._slopes(db, n_sessions, c0), k, c0)

    def _slopes(self, db: int, n_sessions: int, c0: float) -> dict[int, float]:
        """Draft bucket -> a draft's cost as a share of a plain step, measured at the nearest
        depth bucket to ``db`` (whose plain step costs ``c0``) that has draft measurements; {}:
        none has."""
        depths = [
            (abs(d - db), -d)
            for (d, s), cells in self._cells.items()
            if s == n_sessions and any(b > 0 and c.samples for b, c in cells.items())
        ]
        if not depths:
            return {}
        d = -min(depths)[1]
        plain = c0 if d == db else self._plain_cost(d, n_sessions)
        assert plain is not None  # a plain step of this many sessions was measured (c0)
        return {
            b: max(0.0, (cell.seconds / plain - 1.0) / cell.drafts)
            for b, cell in self._cells[(d, n_sessions)].items()
            if b > 0 and cell.samples
        }

    def _plain_cost(self, db: int, n_sessions: int) -> float | None:
        """A plain step's seconds at depth bucket ``db``, else at the nearest measured one."""
        plain = [
            (abs(d - db), -d, cells[0].seconds)
            for (d, s), cells in self._cells.items()
            if s == n_sessions and 0 in cells and cells[0].samples
        ]
        return min(plain)[2] if plain else None


def _best(a: float, c0: float, costs: list[tuple[int, float]]) -> int:
    """Of the draft lengths and their step costs, the one with the most expected tokens per
    second at acceptance ``a``, the shortest of ties (0: a plain step, costing ``c0``)."""
    best, best_rate = 0, 1.0 / c0
    for k, cost in costs:
        emitted = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)  # sum_{i<=k} a^i
        if emitted / cost > best_rate:
            best, best_rate = k, emitted / cost
    return best


def _cost(slopes: dict[int, float], k: int, c0: float) -> float:
    """c0 * (1 + slope * k), the slope of the nearest measured draft bucket (else the prior)."""
    if k == 0:
        return c0
    if not slopes:
        return c0 * (1.0 + COST_SLOPE * k)
    kb = k.bit_length()
    return c0 * (1.0 + slopes[min(slopes, key=lambda b: (abs(b - kb), -b))] * k)


def _candidates(limit: int) -> list[int]:
    """Draft lengths worth comparing: powers of two below ``limit``, and ``limit``."""
    out = []
    k = 1
    while k < limit:
        out.append(k)
        k *= 2
    return [*out, limit] if limit > 0 else out
