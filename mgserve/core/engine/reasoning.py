"""Reasoning budgets: how many tokens a session may write inside its reasoning block
(``<think>...</think>``) before the engine closes the block itself.

The API resolves one ``ReasoningBudget`` per chat request from the template (its markers as token
ids, and whether the prompt ends inside an open block) and the budget asked for. The scheduler
keeps a ``ReasoningTracker`` per session and feeds it every generated token. Once the block holds
``budget`` tokens the tracker names the next ones, the close marker and the blank line after it:
each goes into its step's ``SeqWork.force``, and the runners' samplers draw it through the grammar
mask path (a mask that allows that one token). No kernel is involved, and forcing is per row: the
other sessions of a step are untouched.

A request's grammar (structured output) constrains the answer, not the reasoning: the scheduler
hands it to the runner once the block is closed. Under a grammar only a block the prompt opened
counts: from the first token on, what the model writes is the grammar's (a JSON grammar never
allows an open marker).

A block is closed when the model writes the close marker's token ids (one special token in models
that have one, e.g. Qwen's ``</think>``): the same text tokenized differently goes unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ReasoningBudget:
    """What the engine enforces for one request's reasoning block (api/reasoning.py builds it)."""

    budget: int  # tokens the block may hold (>= 0); -1: no limit (a grammar still waits)
    open: tuple[int, ...]  # the open marker's ids: a block the model opens itself starts so
    close: tuple[int, ...]  # the close marker's ids: the model writing them ends the block
    forced: tuple[int, ...]  # what a spent budget writes: the close marker, then a blank line
    opened: bool  # the prompt ends inside an open block


class Phase(Enum):
    BEFORE = 0  # nothing generated yet that opens or rules out a block
    INSIDE = 1  # in the block, counting its tokens
    FORCING = 2  # the budget is spent: writing ``forced``
    AFTER = 3  # the block is closed (or there never was one): the answer


class ReasoningTracker:
    """Where one session stands with its reasoning block; pure, fed one token at a time."""

    def __init__(self, spec: ReasoningBudget, constrained: bool) -> None:
        self.spec = spec
        self.n = 0  # tokens written inside the block
        self._seen: list[int] = []  # BEFORE: the tokens so far; INSIDE: the last len(close)
        self._i = 0  # FORCING: how many forced tokens were drawn
        self.phase = Phase.AFTER if constrained else Phase.BEFORE  # a grammar allows no opening
        if spec.opened:
            self._enter()

    @property
    def closed(self) -> bool:
        return self.phase is Phase.AFTER

    def forced(self) -> int | None:
        """The token the session's next draw must give, if the budget decides it."""
        return self.spec.forced[self._i] if self.phase is Phase.FORCING else None

    def feed(self, token: int) -> None:
        """The session's next generated token."""
        s = self.spec
        if self.phase is Phase.BEFORE:
            self._seen.append(token)
            if tuple(self._seen) == s.open:
                self._enter()
            elif s.open[: len(self._seen)] != tuple(self._seen):
                self.phase = Phase.AFTER
        elif self.phase is Phase.INSIDE:
            self._seen = [*self._seen, token][-len(s.close) :]
            if tuple(self._seen) == s.close:
                self.phase = Phase.AFTER
            else:
                self.n += 1
                self._check_budget()
        elif self.phase is Phase.FORCING:
            assert token == s.forced[self._i], "the runner did not draw the forced token"
            self._i += 1
            if self._i == len(s.forced):
                self.phase = Phase.AFTER

    def _enter(self) -> None:
        self.phase, self.n, self._seen = Phase.INSIDE, 0, []
        self._check_budget()

    def _check_budget(self) -> None:
        if 0 <= self.spec.budget <= self.n:
            self.phase, self._i = Phase.FORCING, 0
