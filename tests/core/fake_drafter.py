"""A fake ``Drafter`` for the speculation tests, and a driver of scheduler + reference runner.

``Replay`` proposes, for each request, the next tokens of a known continuation (a run with
speculation off: drafts the model accepts), with the positions ``wrong`` picks replaced by another
token (drafts it rejects), and records every call the scheduler makes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mgserve.core.engine.contract import Request, TokenEvent
from mgserve.core.engine.drafting import Drafter
from mgserve.core.engine.runner import ReferenceRunner
from mgserve.core.engine.scheduler import Scheduler


class Replay:
    def __init__(
        self,
        want: Mapping[str, Sequence[int]],
        k: int = 4,
        wrong: Callable[[int], bool] = lambda pos: False,
        n_vocab: int = 64,
    ) -> None:
        self.want = want  # request id -> its continuation (generated tokens, in order)
        self.k = k  # drafts per proposal, at most
        self.wrong = wrong  # continuation index -> propose another token there
        self.n_vocab = n_vocab
        self.generated: dict[str, list[int]] = {}
        self.calls: list[tuple[Any, ...]] = []

    def start(self, req: Request, context: Sequence[int]) -> None:
        self.calls.append(("start", req.id, tuple(context)))
        self.generated[req.id] = []

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        self.calls.append(("extend", request_id, tuple(tokens)))
        self.generated[request_id] += tokens

    def propose(
        self, request_id: str, n_generating: int, depth: int, limit: int
    ) -> tuple[int, ...]:
        self.calls.append(("propose", request_id, n_generating, depth, limit))
        n = len(self.generated[request_id])
        nxt = list(self.want.get(request_id, ()))[n : n + min(self.k, limit)]
        return tuple((t + 1) % self.n_vocab if self.wrong(n + i) else t for i, t in enumerate(nxt))

    def verified(self, request_id: str, n_draft: int, n_accepted: int) -> None:
        self.calls.append(("verified", request_id, n_draft, n_accepted))

    def observe_step(self, n_draft: int, depth: int, n_sessions: int, seconds: float) -> None:
        self.calls.append(("observe", n_draft, depth, n_sessions))

    def finish(self, request_id: str) -> None:
        self.calls.append(("finish", request_id))
        del self.generated[request_id]

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c[1:] for c in self.calls if c[0] == kind]


def serve(
    model: Any,
    reqs: Sequence[Request],
    drafter: Drafter | None = None,
    n_slots: int = 3,
    n_ctx: int = 96,
    batch_size: int = 16,
) -> dict[str, list[TokenEvent]]:
    """Every request's events, the scheduler driving a reference runner until all are done."""
    runner = ReferenceRunner(model, n_slots, n_ctx)
    sched = Scheduler(n_slots, n_ctx, batch_size, rewindable=model.rewindable, drafter=drafter)
    for r in reqs:
        sched.add(r)
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        for ev in sched.apply(runner.run(batch)):
            events[ev.request_id].append(ev)
    return dict(events)


def tokens(events: Mapping[str, list[TokenEvent]]) -> dict[str, list[int | None]]:
    return {rid: [ev.token for ev in evs] for rid, evs in events.items()}


def ends(events: Mapping[str, list[TokenEvent]]) -> dict[str, tuple[str | None, int]]:
    return {rid: (evs[-1].finish_reason, evs[-1].n_generated) for rid, evs in events.items()}
