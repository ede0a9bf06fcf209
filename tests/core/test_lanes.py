"""The prefill lane's scheduler (core/engine/lanes.py), driven on the CPU by a fake runner whose
prompt chunks complete asynchronously: a lane batch is applied only after some decode batches.
The fake computes a token from its session's whole context (like tests/core/fake_model.py), so a
wrong start, a stale context or a mixed-up slot changes the output, and the lane and the
sequential scheduler must give every request the same tokens."""

from __future__ import annotations

import hashlib

from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import (
    PrefixCopy,
    Request,
    ScheduledBatch,
    SeqResult,
    SeqWork,
    StepResult,
    TokenEvent,
)
from mgserve.core.engine.lanes import LaneScheduler
from mgserve.core.engine.scheduler import Scheduler
from mgserve.core.engine.slot_actions import SlotAction
from tests.core.test_scheduler import req


class FakeRunner:
    """Per slot, the tokens its cache holds; a sampled token is a hash of them."""

    def __init__(self) -> None:
        self.ctx: dict[int, list[int]] = {}

    def run(self, batch: ScheduledBatch) -> StepResult:
        res = []
        for w in batch.work:
            held = self.ctx.setdefault(w.slot, [])
            assert len(held) >= w.start, "the slot must hold positions [0, start)"
            held[w.start :] = w.tokens
            if w.sample:
                digest = hashlib.sha256(repr(held).encode()).digest()
                res.append(SeqResult(w.slot, w.request_id, 1 + digest[0] % 50, None, ()))
        return StepResult(batch.step, res, sum(len(w.tokens) for w in batch.work))


Tokens = dict[str, list[int | None]]


def _collect(out: Tokens, events: list[TokenEvent]) -> None:
    for ev in events:
        out.setdefault(ev.request_id, []).append(ev.token)


def sequential(
    s: Scheduler, arrivals: dict[int, list[Request]]
) -> tuple[Tokens, list[ScheduledBatch]]:
    """One step at a time, as the actor runs a runner without lanes."""
    runner = FakeRunner()
    out: Tokens = {}
    batches: list[ScheduledBatch] = []
    for n in range(1000):
        for r in arrivals.get(n, []):
            s.add(r)
        if (b := s.schedule()) is not None:
            batches.append(b)
            _collect(out, s.apply(runner.run(b)))
        elif not s.has_work() and n > max(arrivals):
            return out, batches
    raise AssertionError("did not finish")


def lanes(
    s: LaneScheduler, arrivals: dict[int, list[Request]], lag: int = 3
) -> tuple[Tokens, list[ScheduledBatch], list[tuple[int, int]]]:
    """Each lane batch is applied ``lag`` decode batches after it was planned (at once when
    nothing decodes). Returns the tokens, every batch, and per decode batch planned while a
    chunk was in flight: (its step, the decoders it carried)."""
    runner = FakeRunner()
    out: Tokens = {}
    batches: list[ScheduledBatch] = []
    beside: list[tuple[int, int]] = []
    lane: ScheduledBatch | None = None
    age = 0
    for n in range(1000):
        for r in arrivals.get(n, []):
            s.add(r)
        if lane is None and (lane := s.schedule_lane()) is not None:
            batches.append(lane)
            age = 0
        d = s.schedule()
        if d is not None:
            batches.append(d)
            if lane is not None:
                beside.append((d.step, len(d.work)))
            _collect(out, s.apply(runner.run(d)))
            age += 1
        if lane is not None and (age >= lag or d is None):
            _collect(out, s.apply(runner.run(lane)))
            lane = None
        if lane is None and not s.has_work() and n > max(arrivals):
            return out, batches, beside
    raise AssertionError("did not finish")


LONG = [(7 * i) % 90 + 5 for i in range(41)]  # 41 = 5 chunks of 8 and a last one of 1 token


def arrivals() -> dict[int, list[Request]]:
    return {
        0: [req("d0", [1, 2, 3], max_tokens=30), req("d1", [4, 5], max_tokens=30)],
        3: [req("p", LONG, max_tokens=6)],
        5: [req("q", LONG[:20] + [3, 3], max_tokens=6)],  # shares a prefix with p, waits for a slot
    }


def test_decoders_get_a_token_every_step_while_a_chunk_is_in_flight() -> None:
    s = LaneScheduler(n_slots=3, n_ctx=128, batch_size=8)
    _, batches, beside = lanes(s, arrivals())
    assert len(beside) > 10 and all(n == 2 for _, n in beside[:10])
    n_prompt = {r.id: len(r.prompt) for rs in arrivals().values() for r in rs}
    for b in batches:  # the lane's batches carry prompts, the others generated tokens only
        assert {w.start < n_prompt[w.request_id] for w in b.work} == {b.lane}
        assert b.lane or not (b.freed_slots or b.checkpoint_moves or b.slot_ops)
    assert sum(b.lane for b in batches) == 1 + 6 + 1  # d0 and d1, p in 6 chunks, q past p's 20


def test_tokens_and_chunks_are_those_of_the_sequential_scheduler() -> None:
    seq, seq_batches = sequential(Scheduler(3, 128, 8), arrivals())
    lane, lane_batches, _ = lanes(LaneScheduler(3, 128, 8), arrivals())
    assert lane == seq
    assert [len(t) for t in seq.values()] == [30, 30, 6, 6]

    def chunks(batches: list[ScheduledBatch]) -> list[tuple[str, int, int]]:
        return [(w.request_id, w.start, len(w.tokens)) for b in batches for w in b.work
                if w.request_id in ("p", "q") and len(w.tokens) + w.start <= len(LONG)]  # fmt: skip

    assert chunks(lane_batches) == chunks(seq_batches)
    assert ("p", 40, 1) in chunks(lane_batches)  # the 1-token last chunk, in the lane


def test_recurrent_chunks_and_checkpoints_match_the_sequential_ones() -> None:
    def book() -> CheckpointBook:
        return CheckpointBook(every=16, per_slot=1, host_bytes=100, nbytes=10)

    seq_s = Scheduler(3, 128, 8, rewindable=False, checkpoints=book())
    lane_s = LaneScheduler(3, 128, 8, rewindable=False, checkpoints=book())
    seq, seq_batches = sequential(seq_s, arrivals())
    lane, lane_batches, _ = lanes(lane_s, arrivals())
    assert lane == seq

    def ckpts(batches: list[ScheduledBatch]) -> list[tuple[str, int, bool, bool]]:
        return [(w.request_id, w.start, w.checkpoint, w.restore) for b in batches
                for w in b.work if w.checkpoint or w.restore]  # fmt: skip

    def moves(batches: list[ScheduledBatch]) -> list[object]:
        return [m for b in batches for m in b.checkpoint_moves]

    assert ckpts(lane_batches) == ckpts(seq_batches) != []
    assert moves(lane_batches) == moves(seq_batches) != []
    assert all(b.lane for b in lane_batches if b.checkpoint_moves)
    assert lane_s.checkpoints.held == seq_s.checkpoints.held


def _started(s: LaneScheduler) -> tuple[ScheduledBatch, FakeRunner]:
    """Two decoders in slots 0 and 1, then p's first chunk in flight in the lane (slot 2)."""
    s.add(req("d0", [1, 2], max_tokens=50))
    s.add(req("d1", [3, 4], max_tokens=50))
    runner = FakeRunner()
    first = s.schedule_lane()
    assert first is not None
    s.apply(runner.run(first))
    s.add(req("p", LONG))
    lane = s.schedule_lane()
    assert lane is not None and [w.request_id for w in lane.work] == ["p"]
    return lane, runner


def test_abort_mid_chunk_keeps_the_slot_until_the_chunk_is_applied() -> None:
    s = LaneScheduler(n_slots=3, n_ctx=128, batch_size=8)
    lane, runner = _started(s)
    ev = s.abort("p")
    assert ev is not None and ev.finish_reason == "abort"
    s.add(req("r", LONG[:8] + [9, 9]))  # could reuse p's first chunk from slot 2
    d = s.schedule()
    assert d is not None and {w.request_id for w in d.work} == {"d0", "d1"}
    assert not d.freed_slots and len(s.queue) == 1  # decode batches admit nothing
    assert s.apply(runner.run(lane)) == []  # p's result is stale
    nxt = s.schedule_lane()
    assert nxt is not None and nxt.freed_slots == (2,)
    (w,) = nxt.work
    assert (w.request_id, w.slot, w.start, w.tokens) == ("r", 2, 8, (9, 9))


def test_a_slot_a_decode_batch_holds_takes_no_request_or_slot_op() -> None:
    s = LaneScheduler(n_slots=3, n_ctx=128, batch_size=8)
    lane, runner = _started(s)
    s.apply(runner.run(lane))
    d = s.schedule()
    assert d is not None
    s.abort("d0")  # its token is being computed in slot 0
    s.add(req("r", [8, 8]))
    s.actions.add(SlotAction("save-0", 0, "save"))
    nxt = s.schedule_lane()  # p's next chunk; nothing in slot 0 yet
    assert nxt is not None and {w.slot for w in nxt.work} == {2} and not nxt.slot_ops
    assert nxt.freed_slots == () and len(s.queue) == 1
    s.apply(runner.run(d))
    s.apply(runner.run(nxt))
    op = s.schedule_lane()
    assert op is not None and op.slot_ops and op.slot_ops[0].slot == 0 and op.freed_slots == (0,)
    s.apply(StepResult(op.step))
    after = s.schedule_lane()  # p's next chunk takes the whole batch; r is in slot 0 now
    assert after is not None and [w.request_id for w in after.work] == ["p"]
    r = s.slots[0].session
    assert r is not None and r.req.id == "r" and not s.queue


def test_a_failed_chunk_fails_only_its_request() -> None:
    s = LaneScheduler(n_slots=3, n_ctx=128, batch_size=8)
    lane, runner = _started(s)
    d = s.schedule()
    assert d is not None
    events = s.fail(lane.step, "RuntimeError: boom")
    assert [(e.request_id, e.finish_reason) for e in events] == [("p", "error")]
    assert {e.request_id for e in s.apply(runner.run(d))} == {"d0", "d1"}
    assert s.slots[2].session is None and s.slots[2].cached == []


def test_prefix_copies_ride_the_lane_and_decoders_lend_no_live_state() -> None:
    book = CheckpointBook(every=0, per_slot=4, host_bytes=0, nbytes=1)
    s = LaneScheduler(3, 64, 4, rewindable=False, checkpoints=book, prefix_copy=4)
    runner = FakeRunner()
    s.add(req("a", [*range(1, 11), 20, 21]))  # chunks end at 4, 8, 12; a checkpoint at 8
    while (lane := s.schedule_lane()) is not None:
        s.apply(runner.run(lane))
    d = s.schedule()  # a decodes: its live state is at its history's length when d is applied
    assert d is not None
    s.apply(runner.run(d))
    history = list(s.slots[0].cached)
    s.add(req("b", [*history, 50], slot=1))  # sequentially: a's live state, copied
    d = s.schedule()
    assert d is not None and not d.prefix_copies  # decode batches carry none
    lane = s.schedule_lane()  # with a's decode batch in flight: a lends nothing
    assert lane is not None and not lane.prefix_copies and work_of(lane, "b").start == 0
    s.apply(runner.run(d))
    s.apply(runner.run(lane))
    s.abort("b")
    history = list(s.slots[0].cached)  # a's state is after all of it, a is not in flight
    s.add(req("c", [*history, 60], slot=2))
    lane = s.schedule_lane()  # a lends its checkpoint at 8, not its live state
    assert lane is not None and lane.prefix_copies == (PrefixCopy("c", 0, 2, 8, False),)
    assert work_of(lane, "c").start == 8


def work_of(batch: ScheduledBatch, rid: str) -> SeqWork:
    return next(w for w in batch.work if w.request_id == rid)
