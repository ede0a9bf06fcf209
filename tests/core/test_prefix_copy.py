"""Prefix copy in the scheduler (placement.py): a request whose prompt prefix another slot holds
(busy or idle) gets it copied into its own slot when that reuses at least ``prefix_copy`` tokens
more; the copy rides the next batch, ahead of the request's first work."""

from __future__ import annotations

from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import PrefixCopy, ScheduledBatch, SeqWork
from mgserve.core.engine.scheduler import Scheduler
from tests.core.test_scheduler import answer, req, step

SYS = list(range(1, 11))  # a 10-token system prompt


def work_of(batch: ScheduledBatch, rid: str) -> SeqWork:
    return next(w for w in batch.work if w.request_id == rid)


def copying(copy_min: int = 4) -> tuple[Scheduler, ScheduledBatch]:
    """a decodes in slot 0 when b, sharing its system prompt, comes: b's first step, planned."""
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64, prefix_copy=copy_min)
    s.add(req("a", [*SYS, 20, 21]))
    step(s)  # a's prompt in slot 0; a decodes from now on
    s.add(req("b", [*SYS, 30, 31]))
    b = s.schedule()
    assert b is not None
    return s, b


def test_a_busy_slots_prefix_is_copied_into_the_new_requests_slot() -> None:
    s, b = copying()
    ev = s.apply(answer(b))
    assert b.prefix_copies == (PrefixCopy("b", 0, 1, 10, False),)
    w = work_of(b, "b")
    assert (w.slot, w.start, w.tokens, w.history) == (1, 10, (30, 31), tuple(SYS))
    assert work_of(b, "a").tokens == (7,)  # a decodes beside it
    assert next(e for e in ev if e.request_id == "b").n_cached == 10
    b, _ = step(s)
    assert b.prefix_copies == ()  # a copy rides one batch


def test_the_threshold_and_off() -> None:
    for copy_min, want in ((8, 10), (11, 0), (0, 0)):
        _, b = copying(copy_min)
        assert len(b.prefix_copies) == (want > 0), copy_min
        assert work_of(b, "b").start == want


def test_an_idle_conversation_is_kept_and_its_prefix_copied_to_an_empty_slot() -> None:
    conv = [*SYS, 20, 21, 22, 23, 24, 25]
    for copy_min, slot, n_copies in ((4, 1, 1), (0, 0, 0)):
        s = Scheduler(n_slots=2, n_ctx=64, batch_size=64, prefix_copy=copy_min)
        s.add(req("a", conv, max_tokens=1))
        step(s)  # a ends: slot 0 holds its prompt
        s.add(req("b", [*SYS, 30]))
        b, _ = step(s)
        w = work_of(b, "b")
        assert (w.slot, w.start, len(b.prefix_copies)) == (slot, 10, n_copies)
        # with copies, the conversation's cache is not cut back
        assert s.slots[0].cached == (conv if copy_min else [*SYS, 30])


def test_an_own_cache_that_reaches_as_far_is_not_copied_over() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64, prefix_copy=4)
    s.add(req("a", [*SYS, 20], max_tokens=1))
    s.add(req("b", [*SYS, 30], max_tokens=1))
    step(s)  # both slots hold the system prompt
    s.add(req("c", [*SYS, 40]))
    b, _ = step(s)
    assert b.prefix_copies == () and b.work[0].start == 10


def recurrent(copy_min: int = 4) -> Scheduler:
    """Chunks of 4, a checkpoint at the last chunk end before each prompt's end."""
    book = CheckpointBook(every=0, per_slot=4, host_bytes=0, nbytes=1)
    return Scheduler(
        n_slots=2, n_ctx=64, batch_size=4, rewindable=False, checkpoints=book, prefix_copy=copy_min
    )


def test_a_recurrent_source_lends_its_checkpoint_in_the_common_prefix() -> None:
    s = recurrent()
    s.add(req("a", [*SYS, 20, 21]))  # chunks end at 4, 8, 12; a checkpoint at 8
    for _ in range(3):
        step(s)
    assert s.checkpoints.held == {(0, 8): False}
    s.add(req("b", [*SYS, 30]))  # shares 10 tokens: the checkpoint at 8
    b, _ = step(s)
    assert b.prefix_copies == (PrefixCopy("b", 0, 1, 8, False),)
    w = work_of(b, "b")
    assert (w.start, w.tokens, w.restore) == (8, (9, 10, 30), False)


def test_a_recurrent_source_lends_its_live_state_only_when_it_is_there() -> None:
    s = recurrent()
    s.add(req("a", [*SYS, 20, 21]))
    for _ in range(4):
        step(s)  # the prompt, then 7 fed: a's state is after [*SYS, 20, 21, 7]
    history = list(s.slots[0].cached)
    assert len(history) == 13
    s.add(req("b", [*history, 50], slot=1))  # pinned to the other slot: a copy
    b, _ = step(s)
    assert b.prefix_copies == (PrefixCopy("b", 0, 1, 13, True),)
    assert work_of(b, "b").start == 13

    # planned while a's step is in flight: a's live state is not at its length yet
    s = recurrent()
    s.add(req("a", [*SYS, 20, 21]))
    for _ in range(3):
        step(s)
    b1 = s.schedule()  # a feeds its first token
    assert b1 is not None
    s.add(req("b", [*SYS, 20, 21, 7, 50]))
    b2 = s.schedule()
    assert b2 is not None and b2.prefix_copies == (PrefixCopy("b", 0, 1, 8, False),)
    s.apply(answer(b1))
    s.apply(answer(b2))


def test_a_failed_copy_errors_its_request_and_forgets_the_target() -> None:
    s, b = copying()
    assert b.prefix_copies
    ev = s.fail(b.step, "boom")
    assert {e.request_id: e.finish_reason for e in ev} == {"a": "error", "b": "error"}
    assert s.slots[1].cached == [] and s.slots[1].session is None


def test_aborting_the_source_leaves_the_planned_copy_and_the_target() -> None:
    s, b1 = copying()
    assert b1.prefix_copies
    assert s.abort("a") is not None  # while the copy's step runs
    s.add(req("c", [99, 98]))  # takes a's slot and overwrites it, a step later
    s.apply(answer(b1))
    b2, _ = step(s)
    assert b2.prefix_copies == () and work_of(b2, "c").start == 0
    assert work_of(b2, "b").start == 12
    assert s.slots[1].session is not None and s.slots[1].session.n_cached == 10


def test_a_lent_checkpoint_becomes_the_most_recently_used() -> None:
    book = CheckpointBook(every=4, per_slot=2, host_bytes=0, nbytes=1)
    s = Scheduler(
        n_slots=2, n_ctx=64, batch_size=4, rewindable=False, checkpoints=book, prefix_copy=4
    )
    s.add(req("a", list(range(1, 17))))  # checkpoints at 4, 8, 12: two kept in device memory
    step(s)
    step(s)
    s.add(req("b", [*range(1, 7), 50, 51]))  # shares 6 tokens: a's checkpoint at 4 is lent
    b, _ = step(s)  # a's chunk to 12 makes room: the least recently used, 8, goes
    assert b.prefix_copies == (PrefixCopy("b", 0, 1, 4, False),)
    assert {pos for slot, pos in s.checkpoints.held if slot == 0} == {4, 12}


def test_a_request_that_reuses_nothing_takes_the_least_recently_used_slot() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64, prefix_copy=4)
    s.add(req("a", [*SYS, 20, 21], max_tokens=1))
    step(s)  # slot 0, the least recently used from now on
    s.add(req("b", [40, 41], max_tokens=1))
    step(s)  # slot 1: empty, it loses nothing
    s.add(req("c", [*SYS, 30], reuse_prefix=False))
    b, _ = step(s)
    assert (b.work[0].slot, b.work[0].start, b.prefix_copies) == (0, 0, ())
