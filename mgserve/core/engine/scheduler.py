"""The scheduler: slots, a FIFO queue, and one decision per step.

Pure and synchronous (no asyncio, no torch): the engine actor wraps it, tests drive it with fake
step results. Each step, per session: a decoding session feeds its last sampled token (with a
``drafter``, drafts after it to verify: speculation.py); a session in its prompt feeds a chunk.
Prompt tokens per step are bounded by ``batch_size`` and given oldest request first, to at most
``prefill_sessions`` sessions (0: any number). With a latency target (``itl_target``, seconds)
the budget beside decoders is the pacer's (pacing.py): whole pieces of a chunk, so the cuts stay
where they are.

Prefix reuse: every slot remembers the token ids its cache holds. A new request takes the free slot
whose cache serves the longest prefix of its prompt and starts there (placement.py: a recurrent
state, ``rewindable=False``, serves its whole history or its latest checkpoint in the common
prefix, which the first work restores); with ``prefix_copy`` > 0 a prefix that many tokens
longer held by any other slot, busy or idle, is copied in first (a ``PrefixCopy`` in the next
batch). Recurrent models' prompts are cut on absolute multiples of ``batch_size`` and
``--checkpoint-every`` and at the request's cut hints, where checkpoints are taken
(checkpoints.py).
A request may ask to be served by one slot (``Request.slot``: it waits for that slot, keeping its
place in the queue while later requests take other slots) or to reuse nothing (``reuse_prefix``).
Slot save / restore / erase (slot_actions.py) wait for their slot to be idle and run in a batch
of their own.

A session's work is written into ``Slot.cached`` when it is scheduled, and the session is "in
flight" until the step's result is applied; only sessions not in flight get new work. So the next
step can be planned while the runner executes the current one; the runner runs steps in order
(lanes.py: prompt chunks beside decode steps).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import (
    PrefixCopy,
    Request,
    ScheduledBatch,
    SeqResult,
    SeqWork,
    SlotOp,
    StepResult,
    TokenEvent,
)
from mgserve.core.engine.drafting import Drafter
from mgserve.core.engine.pacing import PrefillPacer
from mgserve.core.engine.placement import Placer
from mgserve.core.engine.reasoning import ReasoningTracker
from mgserve.core.engine.slot_actions import SlotActions, undo
from mgserve.core.engine.slots import Session, Slot
from mgserve.core.engine.speculation import Speculation


class Scheduler:
    def __init__(
        self,
        n_slots: int,
        n_ctx: int,
        batch_size: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        rewindable: bool = True,
        checkpoints: CheckpointBook | None = None,
        itl_target: float = 0.0,
        prefill_sessions: int = 0,
        prefix_copy: int = 0,
        drafter: Drafter | None = None,  # only for a runner whose supports_drafts is True
    ) -> None:
        if n_slots < 1 or n_ctx < 2 or batch_size < 1 or prefill_sessions < 0:
            raise ValueError(
                f"bad scheduler sizes: {n_slots=} {n_ctx=} {batch_size=} {prefill_sessions=}"
            )
        self.n_ctx = n_ctx
        self.batch_size = batch_size
        self.prefill_sessions = prefill_sessions  # sessions given prompt tokens per step (0: any)
        self.pacer = PrefillPacer(itl_target, batch_size)
        self.checkpoints = CheckpointBook.off()  # a KV cache rewinds without them
        if checkpoints is not None and not rewindable:
            self.checkpoints = checkpoints
        self.placer = Placer(rewindable, self.checkpoints, prefix_copy)
        self.slots = [Slot(i) for i in range(n_slots)]
        self.queue: deque[tuple[Request, float]] = deque()
        self.actions = SlotActions()
        self.spec = Speculation(drafter)  # drafts for decoding sessions (speculation.py)
        self._clock = clock
        self._step = 0
        self._freed: list[int] = []
        self._copies: list[PrefixCopy] = []  # planned, for the next batch
        self._in_flight: dict[int, ScheduledBatch] = {}

    # -- requests in and out ---------------------------------------------------------------------

    def add(self, req: Request, t_submit: float | None = None) -> None:
        """Queue ``req``, checked at the API boundary (contract.Request says what holds)."""
        # what the slot arithmetic relies on: a prompt chunk to compute and room to sample after it
        assert 0 < len(req.prompt) < self.n_ctx and req.max_tokens >= 1, "unchecked request"
        req.cut_hints = self.checkpoints.cuts(req.cut_hints, len(req.prompt), self.batch_size)
        self.queue.append((req, self._clock() if t_submit is None else t_submit))

    def abort(self, request_id: str, finish_reason: str = "abort") -> TokenEvent | None:
        """Drop a queued or running request, ending it with ``finish_reason``; None if it is
        unknown (already finished)."""
        for i, (req, _) in enumerate(self.queue):
            if req.id == request_id:
                del self.queue[i]
                return TokenEvent(
                    request_id, None, finish_reason=finish_reason, n_prompt=len(req.prompt)
                )
        for slot in self.slots:
            s = slot.session
            if s is not None and s.req.id == request_id:
                self._release(slot)
                return s.event(slot.id, None, finish_reason=finish_reason)
        return None

    def fail(self, step: int, error: str) -> list[TokenEvent]:
        """The runner failed on ``step``: end its sessions with an error and forget their caches."""
        batch = self._in_flight.pop(step, None)
        self.pacer.discard(step)
        if batch is None:
            return []
        events: list[TokenEvent] = []
        for op in batch.slot_ops:
            undo(op, self.slots[op.slot], self.checkpoints)
        # what the targets of copies and the sessions that worked hold is unknown now
        touched = [(c.dst, c.request_id) for c in batch.prefix_copies]
        for slot_id, request_id in touched + [(w.slot, w.request_id) for w in batch.work]:
            slot = self.slots[slot_id]
            s = slot.session
            slot.cached.clear()
            self.checkpoints.keep(slot.id, -1)
            if s is not None and s.req.id == request_id:
                self._release(slot)
                events.append(s.event(slot.id, None, finish_reason="error", error=error))
        return events

    # -- one step --------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.queue or self.actions.pending) or any(s.session for s in self.slots)

    def schedule(self) -> ScheduledBatch | None:
        """Plan the next step, or None if no session can make progress now."""
        op = self.actions.take(self.slots, self.checkpoints, self._step, self._held())
        if op is not None:
            return self._batch((), (op,))
        self._admit()
        work = self.spec.decode_work(self, self._ready(False))
        n_decode, prompts = len(work), self._ready(True)
        work += self._prompt_work(prompts, self.pacer.budget(n_decode) if prompts else 0)
        if not work:
            return None
        batch = self._batch(tuple(sorted(work, key=lambda w: w.slot)), ())
        self.pacer.planned(batch.step, n_decode, sum(len(w.tokens) for w in work) - n_decode)
        return batch

    def _ready(self, prefilling: bool) -> list[tuple[Slot, Session]]:
        """The sessions that may get work (none in flight), in their prompt or past it."""
        sessions = [(sl, s) for sl in self.slots if (s := sl.session) and not s.in_flight]
        return [(sl, s) for sl, s in sessions if s.prefilling == prefilling]

    def _prompt_work(self, prompts: list[tuple[Slot, Session]], budget: int) -> list[SeqWork]:
        """Prompt chunks of ``prompts``, oldest request first, within ``budget`` tokens, cut where
        they always are (a chunk that does not fit waits instead of being cut shorter, so a
        session's numbers never depend on its neighbours: DESIGN.md)."""
        work = []
        for slot, s in sorted(prompts, key=lambda p: p[1].t_added)[: self.prefill_sessions or None]:
            if s.n_done >= s.chunk[1]:  # the next chunk
                n, cuts = len(s.req.prompt), s.req.cut_hints
                cut = self.checkpoints.chunk_end(s.n_done, n, self.batch_size, cuts)
                s.chunk = (s.n_done, *cut)
            start, end, ckpt = s.chunk
            stop = self.pacer.piece_end(start, s.n_done, end, budget)
            if stop == s.n_done:
                continue
            chunk = tuple(s.req.prompt[s.n_done : stop])
            budget -= len(chunk)
            s.n_done = stop
            work.append(self._work(slot, s, chunk, not s.prefilling, ckpt and stop == end))
        return work

    def _batch(self, work: tuple[SeqWork, ...], ops: tuple[SlotOp, ...], lane: bool = False,
               chores: bool = True) -> ScheduledBatch:  # fmt: skip
        """The next step, in flight from now; with ``chores`` the moves and freed slots ride it."""
        self._step += 1
        held = self._held() if chores else set(self._freed)
        freed = tuple(s for s in dict.fromkeys(self._freed) if s not in held)
        self._freed = [s for s in self._freed if s in held]
        moves = self.checkpoints.take_moves() if chores else ()
        copies, self._copies = (tuple(self._copies), []) if chores else ((), self._copies)
        batch = ScheduledBatch(self._step, work, freed, moves, ops, copies, lane)
        self._in_flight[batch.step] = batch
        return batch

    def _held(self) -> set[int]:
        """Slots a batch in flight holds: none here, the runner runs the steps in order (lanes.py
        runs two at once)."""
        return set()

    def observe(self, step: int, seconds: float) -> None:
        """The engine measured ``step``: from its planning to its tokens delivered."""
        self.pacer.observe(step, seconds)

    def apply(self, result: StepResult) -> list[TokenEvent]:
        """Apply sampled tokens (1 + accepted drafts per session: speculation.py); returns one
        event per token for requests still running."""
        return self.spec.apply(self, self._in_flight.pop(result.step), result)

    # -- internals -------------------------------------------------------------------------------

    def _admit(self) -> None:
        pinned: list[tuple[Request, float]] = []  # waiting for their busy slot, in queue order
        held = self._held()
        idle = [s for s in self.slots if s.session is None and s.id not in held]
        idle = [s for s in idle if not self.actions.holds(s.id)]
        while self.queue and any(s.session is None for s in idle):
            req, t_added = self.queue.popleft()
            free = [s for s in idle if s.session is None and req.slot in (None, s.id)]
            if not free:  # pinned to a busy slot
                pinned.append((req, t_added))
                continue
            lenders = [sl for sl in self.slots if sl.id not in held]
            slot, n_cached, restore, copy = self.placer.place(req, free, lenders)
            if copy is None:
                del slot.cached[n_cached:]
                self.checkpoints.keep(slot.id, n_cached)
            else:  # the slot's own rows and checkpoints give way to the copy
                slot.cached[:] = req.prompt[:n_cached]
                self.checkpoints.keep(slot.id, -1)
                self.checkpoints.touch(copy.src, copy.n)
                self._copies.append(copy)
            rb, constrained = req.reasoning, req.grammar is not None
            think = None if rb is None else ReasoningTracker(rb, constrained)
            slot.cuts = req.cut_hints  # it agrees with them up to n_cached (placement.py)
            slot.session = Session(req, t_added, n_cached, n_done=n_cached, restore=restore,
                                   reasoning=think, grammar_pending=constrained)  # fmt: skip
            slot.last_used = self._step
            self.spec.start(req)
        self.queue.extendleft(reversed(pinned))

    def _work(
        self, slot: Slot, s: Session, tokens: tuple[int, ...], sample: bool, ckpt: bool = False
    ) -> SeqWork:
        start = len(slot.cached)
        think = s.reasoning if sample else None
        grammar = None  # the grammar constrains the answer: it waits for the reasoning to close
        if sample and s.grammar_pending and (think is None or think.closed):
            grammar, s.grammar_pending = s.req.grammar, False
        w = SeqWork(slot.id, s.req.id, tokens, start, sample, s.req.sampling,
                    new_sequence=s.new_sequence,
                    history=tuple(slot.cached) if s.new_sequence else (),
                    grammar=grammar, force=think.forced() if think is not None else None,
                    restore=s.restore and s.new_sequence, checkpoint=ckpt)  # fmt: skip
        if ckpt:
            self.checkpoints.add(slot.id, start + len(tokens))
        slot.cached.extend(tokens)
        s.new_sequence = False
        s.in_flight = True
        return w

    def _on_token(self, slot: Slot, s: Session, r: SeqResult) -> TokenEvent:
        s.generated.append(r.token)
        if s.reasoning is not None:
            s.reasoning.feed(r.token)
        if s.t_prompt_done is None:
            s.t_prompt_done = self._clock() - s.t_added
        reason: str | None = None
        if not s.req.ignore_eos and r.token in s.req.stop_token_ids:
            reason = "stop"
        elif len(s.generated) >= s.req.max_tokens or len(slot.cached) >= self.n_ctx:
            reason = "length"  # max_tokens, or no room left to feed this token back
        ev = s.event(slot.id, r.token, finish_reason=reason, logprob=r.logprob, top=r.top)
        if reason is not None:
            self._release(slot)
        return ev

    def _release(self, slot: Slot) -> None:
        if slot.session is not None:
            self.spec.finish(slot.session.req.id)
        slot.session = None
        self._freed.append(slot.id)

    # -- introspection (for /slots and metrics) --------------------------------------------------

    def slot_info(self) -> list[dict[str, object]]:
        held = self.checkpoints.held.items()
        spec = self.spec.drafter is not None
        return [
            sl.info(self.n_ctx, {p: h for (i, p), h in held if i == sl.id}, spec)
            for sl in self.slots
        ]

    @property
    def n_busy(self) -> int:
        return sum(s.session is not None for s in self.slots)
