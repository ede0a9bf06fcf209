"""The scheduler's admission: a request pinned to a slot (llama-server's id_slot) and one that
reuses no cached prefix (cache_prompt: false)."""

from __future__ import annotations

import pytest

from mgserve.core.engine.scheduler import Scheduler
from tests.core.test_scheduler import req, step


def test_a_pinned_request_waits_for_its_slot_and_keeps_its_place() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2], max_tokens=3))
    step(s)
    assert s.slots[0].session is not None and s.slots[0].session.req.id == "a"
    s.add(req("b", [3, 4], slot=0))  # slot 0 is a's: b waits
    s.add(req("c", [5, 6]))  # later, unpinned: takes the free slot 1 meanwhile
    b, _ = step(s)
    assert {w.request_id: w.slot for w in b.work} == {"a": 0, "c": 1}
    assert [r.id for r, _ in s.queue] == ["b"]
    s.add(req("d", [7]))  # arrives after b: b still goes first when slot 0 frees
    _, ev = step(s)
    assert [e.finish_reason for e in ev if e.request_id == "a"] == ["length"]
    b, ev = step(s)
    assert {w.request_id: w.slot for w in b.work} == {"b": 0, "c": 1}
    assert [e.slot for e in ev if e.request_id == "b"] == [0]
    assert [r.id for r, _ in s.queue] == ["d"]


def test_a_pinned_request_takes_its_free_slot_over_a_better_cache() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2, 3, 4], max_tokens=1))
    step(s)  # slot 0 holds 1 2 3 4
    s.add(req("b", [1, 2, 3, 4, 5], slot=1))
    b, _ = step(s)
    (w,) = b.work
    assert (w.slot, w.start, w.tokens) == (1, 0, (1, 2, 3, 4, 5))
    assert s.slots[0].cached == [1, 2, 3, 4]  # the other slot's cache is left alone


@pytest.mark.parametrize("rewindable", [True, False])
def test_reuse_prefix_off_computes_the_whole_prompt(rewindable: bool) -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64, rewindable=rewindable)
    s.add(req("a", [1, 2, 3, 4], max_tokens=1))
    step(s)  # slot 0 holds 1 2 3 4
    s.add(req("b", [1, 2, 3, 4, 5], reuse_prefix=False))
    b, ev = step(s)
    (w,) = b.work
    # the least recently used slot (1), from position 0: slot 0's cache stays for others
    assert (w.slot, w.start, w.tokens) == (1, 0, (1, 2, 3, 4, 5))
    assert w.new_sequence and w.history == ()
    assert ev[0].n_cached == 0
    s.add(req("c", [1, 2, 3, 4, 6], max_tokens=1))  # reuse on: slot 0's prefix
    b, ev = step(s)
    (w,) = [w for w in b.work if w.request_id == "c"]
    assert (w.slot, w.start) == (0, 4)


def test_reuse_prefix_off_in_a_pinned_slot_drops_its_cache() -> None:
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2, 3, 4], max_tokens=1))
    step(s)
    s.add(req("b", [1, 2, 3, 4, 5], slot=0, reuse_prefix=False))
    b, ev = step(s)
    assert [(w.slot, w.start, len(w.tokens)) for w in b.work] == [(0, 0, 5)]
    assert ev[0].n_cached == 0 and s.slots[0].cached == [1, 2, 3, 4, 5]
