"""Speculation on the scheduler's side: drafts into a decoding session's work, the verified
tokens back into the session (the runner's side is ``SeqWork.n_draft`` and verify.py).

With a ``Drafter`` (drafting.py; the engine passes one only to a runner whose
``supports_drafts`` is True), each decoding session's entry becomes (last token, d1..dk) with
``n_draft`` = k, when the request allows it: ``speculative``, no grammar, and no reasoning budget
that could force a token inside the run (a tracker with no budget, or a closed block, drafts; one
counting toward a budget drafts only up to the token before the budget is spent). k is at most
what ``max_tokens`` leaves after the token this step surely gives, the positions left in the
slot, and ``draft_max``; fewer than ``draft_min`` drafts are not sent.

The runner returns 1 + accepted tokens. They go through ``_on_token`` in order, as plain decode
would apply them one step at a time (stop tokens, ``max_tokens`` and the context end see each
token with the slot length plain decode would have then); the first that ends the request drops
the rest. ``Slot.cached`` holds only the real input while the step is in flight (so nothing
planned meanwhile, e.g. a prefix copy, counts on a draft), and after it exactly what the runner
keeps: tokens[: accepted + 1] past ``start``, every accepted draft (a recurrent state is there,
even when the request stopped at an earlier one of those tokens).

The drafter hears of every request placed (``start``, with its prompt), every token emitted
(``extend``), every verified step (``verified``), every step of decode rows only
(``observe_step``: its cost table) and every end (``finish``, from the scheduler's release).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mgserve.core.engine.contract import (
    Request,
    ScheduledBatch,
    SeqResult,
    SeqWork,
    StepResult,
    TokenEvent,
)
from mgserve.core.engine.drafting import Drafter
from mgserve.core.engine.reasoning import Phase
from mgserve.core.engine.slots import Session, Slot

if TYPE_CHECKING:
    from mgserve.core.engine.scheduler import Scheduler


class Speculation:
    """The scheduler's link to its drafter (None: no speculation, every entry is one token)."""

    def __init__(self, drafter: Drafter | None) -> None:
        self.drafter = drafter

    def start(self, req: Request) -> None:
        if self.drafter is not None:
            self.drafter.start(req, req.prompt)

    def finish(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.finish(request_id)

    # -- planning --------------------------------------------------------------------------------

    def decode_work(self, sched: Scheduler, ready: list[tuple[Slot, Session]]) -> list[SeqWork]:
        """Each ready decoding session's entry: its last token, then the drafts it gets."""
        n_gen = sum(1 for sl in sched.slots if sl.session and not sl.session.prefilling)
        work = []
        for slot, s in ready:
            drafts = self._drafts(sched, slot, s, n_gen) if self.drafter is not None else ()
            w = sched._work(slot, s, (s.generated[-1],), True)
            if drafts:
                w = dataclasses.replace(w, tokens=(*w.tokens, *drafts), n_draft=len(drafts))
            work.append(w)
        return work

    def _drafts(self, sched: Scheduler, slot: Slot, s: Session, n_gen: int) -> tuple[int, ...]:
        req, depth = s.req, len(slot.cached)
        limit = min(
            req.max_tokens - len(s.generated) - 1,  # the tokens left after this step's first
            sched.n_ctx - depth - 1,  # positions depth + 1 .. n_ctx - 1 (depth takes the input)
            req.draft_max if req.draft_max is not None else sched.n_ctx,
            _unforced(s),
        )
        if not req.speculative or req.grammar is not None or limit <= 0:
            return ()
        assert self.drafter is not None
        drafts = tuple(self.drafter.propose(req.id, n_gen, depth=depth, limit=limit))[:limit]
        return drafts if len(drafts) >= max(req.draft_min, 1) else ()

    # -- results ---------------------------------------------------------------------------------

    def apply(
        self, sched: Scheduler, batch: ScheduledBatch, result: StepResult
    ) -> list[TokenEvent]:
        """``Scheduler.apply``: a step's tokens into its sessions, an event per token."""
        self.observe(sched, batch, result)
        by_slot: dict[int, list[SeqResult]] = {}  # 1 + accepted drafts per session, in order
        for r in result.results:
            by_slot.setdefault(r.slot, []).append(r)
        events: list[TokenEvent] = []
        for w in batch.work:
            slot = sched.slots[w.slot]
            s = slot.session
            if s is None or s.req.id != w.request_id:  # aborted meanwhile: the result is stale
                if s is None:  # and not reassigned: the slot holds what the runner kept
                    self.settle(slot, w, len(by_slot.get(w.slot, ())))
                continue
            s.in_flight = False
            if w.request_id in result.failed:  # its own sampling failed: it alone ends
                events.append(_failed(sched, slot, s, result.failed[w.request_id]))
            elif w.sample:
                events += self._tokens(sched, slot, s, w, by_slot[w.slot])
        return events

    def _tokens(
        self, sched: Scheduler, slot: Slot, s: Session, w: SeqWork, results: list[SeqResult]
    ) -> list[TokenEvent]:
        """A session's 1 + accepted tokens, in order, until the first that ends it (a prompt
        chunk or a plain decode entry: its one token)."""
        assert all(r.request_id == w.request_id for r in results)
        assert 1 <= len(results) <= 1 + w.n_draft, (len(results), w.n_draft)
        if w.n_draft:
            accepted = [r.token for r in results[:-1]]
            assert tuple(accepted) == w.tokens[1 : len(results)], (accepted, w.tokens)
            if self.drafter is not None:
                self.drafter.verified(s.req.id, w.n_draft, len(results) - 1)
            del slot.cached[w.start + 1 :]  # it already is so, unless planned otherwise
        events = []
        for i, r in enumerate(results):
            if i:
                slot.cached.append(w.tokens[i])  # the accepted draft, fed before row i
            if self.drafter is not None:
                self.drafter.extend(s.req.id, (r.token,))
            events.append(sched._on_token(slot, s, r))
            if events[-1].finish_reason is not None:
                break
        self.settle(slot, w, len(results))
        return events

    @staticmethod
    def settle(slot: Slot, w: SeqWork, n_results: int) -> None:
        """After a verify step (its session running, ended or aborted): the slot holds what the
        runner kept, tokens[: n_results] past ``start``."""
        if w.n_draft:
            slot.cached[w.start :] = w.tokens[:n_results]

    def observe(self, sched: Scheduler, batch: ScheduledBatch, result: StepResult) -> None:
        """Tell the drafter what a step of decode rows only cost (before ``apply`` ends any)."""
        if self.drafter is None or not batch.work:
            return
        for w in batch.work:
            s = sched.slots[w.slot].session
            if s is None or s.req.id != w.request_id or not w.sample or s.prefilling:
                return  # a prompt chunk, or a session gone (the step is not known to be decode)
            if w.start < len(s.req.prompt):
                return  # the last chunk of a prompt
        n_draft = max(w.n_draft for w in batch.work)
        depth = max(w.start for w in batch.work)
        self.drafter.observe_step(n_draft, depth, len(batch.work), result.seconds)


def _failed(sched: Scheduler, slot: Slot, s: Session, error: str) -> TokenEvent:
    """End a session whose own sampling failed (StepResult.failed; the step's others go on). What
    its slot holds is not trusted afterwards: as after a failed step, its cache is forgotten."""
    slot.cached.clear()
    sched.checkpoints.keep(slot.id, -1)
    sched._release(slot)
    return s.event(slot.id, None, finish_reason="error", error=error)


def _unforced(s: Session) -> int:
    """Drafts the session's reasoning budget allows: a row drawn once the budget is spent is
    forced (SeqWork.force), which a verify entry never is. Row i of a run is drawn after i more
    tokens, so with n of ``budget`` tokens in the block rows up to budget - n - 1 are free."""
    t = s.reasoning
    if t is None or t.spec.budget < 0 or t.phase is Phase.AFTER:
        return 1 << 30
    if t.phase is Phase.INSIDE:
        return t.spec.budget - t.n - 1
    return 0  # forcing now, or before a block that may open and start counting
