"""A scheduler's slots and the sessions placed in them (the scheduler's own records)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mgserve.core.engine.contract import Request
from mgserve.core.engine.reasoning import ReasoningTracker


@dataclass
class Session:
    """A request placed in a slot."""

    req: Request
    t_added: float  # clock() when the request was submitted
    n_cached: int  # prompt tokens reused from the slot's cache
    n_done: int  # prompt tokens already in the cache (n_cached included)
    generated: list[int] = field(default_factory=list)
    in_flight: bool = False  # work scheduled, result not yet applied
    new_sequence: bool = True  # the next work is the first of this request in its slot
    restore: bool = False  # the first work restores the slot's checkpoint at n_cached
    t_prompt_done: float | None = None
    reasoning: ReasoningTracker | None = None  # the request's reasoning block, fed every token
    grammar_pending: bool = False  # the request's grammar is not yet with the runner
    # the prompt chunk being computed: start, end, a checkpoint at its end (checkpoints.py)
    chunk: tuple[int, int, bool] = (0, 0, False)

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.req.prompt)


@dataclass
class Slot:
    id: int
    cached: list[int] = field(default_factory=list)  # token ids held by the cache, positions 0..
    session: Session | None = None
    last_used: int = -1  # step of the last assignment, to evict the least recently used cache


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
