from __future__ import annotations

import pytest

from mgserve.core.engine.contract import (
    Request,
    SamplingParams,
    ScheduledBatch,
    SeqResult,
    StepResult,
    TokenEvent,
)
from mgserve.core.engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0)


def req(rid: str, prompt: list[int], max_tokens: int = 100, **kw: object) -> Request:
    return Request(rid, prompt, GREEDY, max_tokens, **kw)  # type: ignore[arg-type]


def answer(batch: ScheduledBatch, token: int = 7, **per_slot: int) -> StepResult:
    """A fake runner: every work that wants a sample gets ``token`` (or per_slot["s<slot>"])."""
    res = [
        SeqResult(w.slot, w.request_id, per_slot.get(f"s{w.slot}", token), None, ())
        for w in batch.work
        if w.sample
    ]
    return StepResult(batch.step, res, sum(len(w.tokens) for w in batch.work))


def step(s: Scheduler, token: int = 7, **per_slot: int) -> tuple[ScheduledBatch, list[TokenEvent]]:
    b = s.schedule()
    assert b is not None
    return b, s.apply(answer(b, token, **per_slot))


def run_to_decode(s: Scheduler) -> None:
    """Step until no session is still in its prompt."""
    while any(sl.session and sl.session.prefilling for sl in s.slots):
        step(s)


def test_prompt_is_chunked_by_the_budget() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=4)
    s.add(req("a", list(range(1, 11))))
    chunks = []
    for _ in range(3):
        b, ev = step(s)
        (w,) = b.work
        chunks.append((w.start, w.tokens, w.sample))
    assert chunks == [
        (0, (1, 2, 3, 4), False),
        (4, (5, 6, 7, 8), False),
        (8, (9, 10), True),
    ]
    assert [e.token for e in ev] == [7]
    b, _ = step(s)
    assert [(w.start, w.tokens, w.sample) for w in b.work] == [(10, (7,), True)]


def test_decoders_run_beside_a_chunked_prompt() -> None:
    s = Scheduler(n_slots=3, n_ctx=64, batch_size=4)
    s.add(req("a", [1, 2]))
    s.add(req("b", [3, 4]))
    step(s)  # both prompts fit in one step
    s.add(req("c", list(range(10, 20))))
    b, ev = step(s)
    by_id = {w.request_id: w for w in b.work}
    assert by_id["a"].tokens == (7,) and by_id["a"].sample
    assert by_id["b"].tokens == (7,) and by_id["b"].sample
    assert by_id["c"].tokens == (10, 11, 12, 13) and not by_id["c"].sample
    assert sorted(e.request_id for e in ev) == ["a", "b"]


def test_prompt_budget_goes_to_the_oldest_request_first() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=4)
    s.add(req("old", [1, 2, 3, 4, 5, 6]))
    s.add(req("new", [9, 8, 7, 6, 5, 4]))
    b, _ = step(s)
    assert [(w.request_id, len(w.tokens)) for w in b.work] == [("old", 4)]
    b, _ = step(s)
    # the new prompt's first chunk (4 tokens) does not fit the 2 left: it waits rather than being
    # cut at a place that depends on its neighbour
    assert [(w.request_id, len(w.tokens)) for w in b.work] == [("old", 2)]
    b, _ = step(s)
    assert ("new", (9, 8, 7, 6)) in [(w.request_id, w.tokens) for w in b.work]


def _prompt_chunks(s: Scheduler, rid: str, n_prompt: int, steps: int = 8) -> list[tuple[int, ...]]:
    out = []
    for _ in range(steps):
        b, _ = step(s)
        out += [w.tokens for w in b.work if w.request_id == rid and w.start < n_prompt]
    return out


def test_prompt_chunks_are_cut_at_the_same_places_alone_and_beside_others() -> None:
    prompt = list(range(100, 110))
    alone = Scheduler(n_slots=2, n_ctx=64, batch_size=4)
    alone.add(req("x", prompt))
    crowded = Scheduler(n_slots=2, n_ctx=64, batch_size=4)
    crowded.add(req("y", [1, 2, 3]))
    crowded.add(req("x", prompt))
    assert (
        _prompt_chunks(alone, "x", 10)
        == _prompt_chunks(crowded, "x", 10)
        == [(100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    )


def test_prefix_reuse_takes_the_slot_with_the_longest_common_prefix() -> None:
    s = Scheduler(n_slots=3, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2, 9, 9], max_tokens=1))
    s.add(req("b", [1, 2, 3, 4, 5], max_tokens=1))
    s.add(req("c", [8, 8], max_tokens=1))
    _, ev = step(s)
    assert all(e.finish_reason == "length" for e in ev)
    slot_of_b = next(sl.id for sl in s.slots if sl.cached[:5] == [1, 2, 3, 4, 5])

    s.add(req("d", [1, 2, 3, 4, 6, 6]))
    b, ev = step(s)
    (w,) = b.work
    assert w.slot == slot_of_b
    assert w.start == 4 and w.tokens == (6, 6)
    assert w.new_sequence and w.history == (1, 2, 3, 4)
    assert ev[0].n_cached == 4 and ev[0].n_prompt == 6
    assert set(b.freed_slots) == {0, 1, 2}


def test_a_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=64)
    s.add(req("a", [5, 6, 7], max_tokens=2))
    step(s)
    step(s)
    s.add(req("b", [5, 6, 7, 7]))  # the cache holds 5 6 7 7 (prompt + fed first token)
    b, ev = step(s)
    assert [(w.start, w.tokens) for w in b.work] == [(3, (7,))]
    assert ev[0].n_cached == 3


def test_requests_queue_when_all_slots_are_busy() -> None:
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2], max_tokens=2))
    s.add(req("b", [3, 4], max_tokens=1))
    b, _ = step(s)
    assert [w.request_id for w in b.work] == ["a"] and len(s.queue) == 1
    b, ev = step(s)
    assert ev[0].finish_reason == "length"
    b, ev = step(s)
    assert [w.request_id for w in b.work] == ["b"] and b.freed_slots == (0,)
    assert not s.queue


def test_abort_mid_prompt_frees_the_slot_and_drops_the_stale_result() -> None:
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=2)
    s.add(req("a", [1, 2, 3, 4, 5, 6]))
    s.add(req("b", [1, 2, 3, 9]))
    b1 = s.schedule()
    assert b1 is not None and b1.work[0].request_id == "a"
    ev = s.abort("a")
    assert ev is not None and ev.finish_reason == "abort" and ev.token is None
    assert s.apply(answer(b1)) == []  # a's chunk finished after the abort: nothing to report
    assert s.abort("a") is None
    b2, _ = step(s)
    (w,) = b2.work
    assert w.request_id == "b" and b2.freed_slots == (0,)
    assert w.start == 2 and w.tokens == (3, 9)  # a's first chunk (1 2) is reused


def test_abort_mid_decode_and_abort_while_queued() -> None:
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2]))
    s.add(req("b", [3]))
    s.add(req("c", [4]))
    step(s)
    step(s)
    ev_c = s.abort("c")
    assert ev_c is not None and ev_c.finish_reason == "abort" and len(s.queue) == 1
    b = s.schedule()
    assert b is not None
    ev_a = s.abort("a")
    assert ev_a is not None and ev_a.n_generated == 2
    assert s.apply(answer(b)) == []
    b, ev = step(s)
    assert [w.request_id for w in b.work] == ["b"] and ev[0].request_id == "b"


def test_stop_token_ends_with_stop_unless_ignore_eos() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64)
    s.add(req("a", [1], stop_token_ids=frozenset({2})))
    s.add(req("b", [5], stop_token_ids=frozenset({2}), ignore_eos=True))
    _, ev = step(s, token=2)
    got = {e.request_id: e for e in ev}
    assert got["a"].finish_reason == "stop" and got["a"].token == 2
    assert got["b"].finish_reason is None
    assert s.slots[0].session is None and s.slots[1].session is not None


def test_max_tokens_and_context_end_give_length() -> None:
    s = Scheduler(n_slots=2, n_ctx=8, batch_size=64)
    s.add(req("short", [1, 2], max_tokens=3))
    s.add(req("long", [3, 4, 5, 6, 7]))
    done: dict[str, TokenEvent] = {}
    counts = {"short": 0, "long": 0}
    while len(done) < 2:
        _, evs = step(s)
        for e in evs:
            counts[e.request_id] += 1
            if e.finish_reason:
                done[e.request_id] = e
    assert done["short"].finish_reason == "length" and counts["short"] == 3
    # 5 prompt tokens + 3 fed tokens fill 8 positions; the 4th token is sampled but cannot be fed
    assert done["long"].finish_reason == "length" and counts["long"] == 4
    assert done["long"].n_generated == 4
    assert max(len(sl.cached) for sl in s.slots) == 8


def test_events_name_the_slot_that_serves_the_request() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2, 3], max_tokens=2))
    s.add(req("b", [4, 5], max_tokens=2))
    s.add(req("c", [6]))  # waits: both slots are busy
    _, evs = step(s, s0=11, s1=12)
    slot_of = {sl.session.req.id: sl.id for sl in s.slots if sl.session}
    assert sorted(slot_of) == ["a", "b"]
    assert [(e.request_id, e.slot, e.token) for e in evs] == [
        (rid, slot_of[rid], 11 + slot_of[rid]) for rid in ("a", "b")
    ]
    _, evs = step(s)  # a and b end; their slots go back
    assert {(e.request_id, e.slot, e.finish_reason) for e in evs} == {
        ("a", slot_of["a"], "length"),
        ("b", slot_of["b"], "length"),
    }
    _, evs = step(s)  # c takes a freed slot
    (c,) = [sl for sl in s.slots if sl.session]
    assert [(e.request_id, e.slot) for e in evs] == [("c", c.id)]
    abort_c = s.abort("c")
    assert abort_c is not None and abort_c.slot == c.id
    s.add(req("d", [7]))
    assert s.abort("d") == TokenEvent("d", None, finish_reason="abort", n_prompt=1)  # no slot yet


def test_failed_step_errors_its_requests_and_forgets_their_caches() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=64)
    s.add(req("a", [1, 2, 3]))
    step(s)
    b = s.schedule()
    assert b is not None
    s.add(req("b", [1, 2, 3]))  # arrives while the step runs
    evs = s.fail(b.step, "boom")
    assert [(e.request_id, e.finish_reason, e.error) for e in evs] == [("a", "error", "boom")]
    b, _ = step(s)
    assert [(w.request_id, w.start) for w in b.work] == [("b", 0)]  # nothing reused


def test_timings_and_slot_info() -> None:
    now = [100.0]
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=2, clock=lambda: now[0])
    s.add(req("a", [1, 2, 3]))
    now[0] = 101.0
    _, ev = step(s)
    assert ev == []
    now[0] = 102.5
    _, ev = step(s)
    assert ev[0].t_prompt_done == pytest.approx(2.5)
    info = s.slot_info()
    params = info[0].pop("params")
    assert info[0] == {
        "id": 0,
        "n_ctx": 64,
        "speculative": False,
        "is_processing": True,
        "id_task": "a",
        "state": "generating",
        "n_past": 3,
        "checkpoints": [],
        "n_prompt_tokens": 3,
        "n_prompt_tokens_cache": 0,
        "n_prompt_tokens_processed": 3,
        "next_token": [{"has_next_token": True, "n_remain": 99, "n_decoded": 1}],
    }
    assert params["n_predict"] == 100 and params["seed"] == -1  # type: ignore[index]
    assert info[1] == {
        "id": 1,
        "n_ctx": 64,
        "speculative": False,
        "is_processing": False,
        "id_task": None,
        "state": "idle",
        "n_past": 0,
        "checkpoints": [],
    }
    assert s.n_busy == 1


def test_pipelined_planning_skips_sessions_in_flight() -> None:
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=2)
    s.add(req("a", [1, 2, 3, 4, 5, 6]))
    b1 = s.schedule()
    s.add(req("b", [7, 8]))
    b2 = s.schedule()  # planned while b1 runs: only b may go
    assert b1 is not None and b2 is not None
    assert [w.request_id for w in b2.work] == ["b"]
    s.apply(answer(b1))
    ev = s.apply(answer(b2))
    assert [e.request_id for e in ev] == ["b"]
    b3 = s.schedule()
    assert b3 is not None and {w.request_id for w in b3.work} == {"a", "b"}


def test_recurrent_state_is_reused_only_when_the_whole_history_starts_the_prompt() -> None:
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=64, rewindable=False)
    s.add(req("a", [1, 2, 3, 4], max_tokens=2))
    step(s, token=7)  # the prompt; samples 7
    _, ev = step(s, token=9)  # feeds 7, samples 9: history [1, 2, 3, 4, 7] (9 was not fed)
    assert ev[-1].finish_reason == "length"
    s.add(req("b", [1, 2, 3, 4, 7, 9, 5]))  # extends the whole history: reused
    b, _ = step(s)
    assert (b.work[0].start, b.work[0].tokens) == (5, (9, 5))
    s.abort("b")
    s.add(req("c", [1, 2, 3, 8]))  # shares only [1, 2, 3]: a recurrent state cannot go back
    b, _ = step(s)
    assert (b.work[0].start, b.work[0].tokens) == (0, (1, 2, 3, 8))
