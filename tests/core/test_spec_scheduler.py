"""The scheduler's side of speculation (speculation.py) with fake step results: which sessions get
drafts and how many, what ``Slot.cached`` holds while a verify step is in flight and after it,
how 1 + accepted tokens become events, and every call the drafter gets."""

from __future__ import annotations

from mgserve.core.engine.contract import (
    Request,
    SamplingParams,
    ScheduledBatch,
    SeqResult,
    StepResult,
    TokenEvent,
)
from mgserve.core.engine.lanes import LaneScheduler
from mgserve.core.engine.reasoning import ReasoningBudget
from mgserve.core.engine.scheduler import Scheduler
from tests.core.fake_drafter import Replay

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 2, 3, 4, 5]
CONT = [7, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # what the drafter replays after PROMPT


def req(rid: str = "a", max_tokens: int = 100, **kw: object) -> Request:
    return Request(rid, list(PROMPT), GREEDY, max_tokens, **kw)  # type: ignore[arg-type]


def run(s: Scheduler, *tokens_per_work: list[int], seconds: float = 0.5) -> list[TokenEvent]:
    """Plan a step; its works (in order) get the given tokens back."""
    b = s.schedule()
    assert b is not None and len(b.work) == len(tokens_per_work)
    return s.apply(answer(b, *tokens_per_work, seconds=seconds))


def answer(b: ScheduledBatch, *tokens_per_work: list[int], seconds: float = 0.5) -> StepResult:
    res = [
        SeqResult(w.slot, w.request_id, t, None, ())
        for w, toks in zip(b.work, tokens_per_work, strict=True)
        for t in toks
    ]
    return StepResult(b.step, res, sum(len(w.tokens) for w in b.work), seconds)


def started(drafter: Replay, **kw: object) -> Scheduler:
    """One request through its prompt (its first token 7), the drafter attached."""
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=8, drafter=drafter, **kw)  # type: ignore[arg-type]
    s.add(req())
    assert [e.token for e in run(s, [7])] == [7]
    return s


def test_a_partly_accepted_step_emits_its_tokens_and_trims_the_slot() -> None:
    d = Replay({"a": [7, 20, 21, 99]}, k=3)  # the third draft (99) is wrong
    s = started(d)
    slot = s.slots[0]
    b = s.schedule()
    assert b is not None
    (w,) = b.work
    assert (w.tokens, w.start, w.n_draft) == ((7, 20, 21, 99), 5, 3)
    assert slot.cached == [*PROMPT, 7]  # in flight: only the real input counts as held
    events = s.apply(answer(b, [20, 21, 22]))  # 20, 21 accepted; 22 the model's own
    assert [(e.token, e.n_generated, e.finish_reason) for e in events] == [
        (20, 2, None),
        (21, 3, None),
        (22, 4, None),
    ]
    assert slot.cached == [*PROMPT, 7, 20, 21]  # what the runner keeps: tokens[: 2 + 1]
    assert d.calls == [
        ("start", "a", tuple(PROMPT)),
        ("extend", "a", (7,)),
        ("propose", "a", 1, 5, 58),  # one session generating, 5 deep: positions 6..63 left
        ("observe", 3, 5, 1),  # a decode-only step: 3 drafts, 5 deep, 1 session
        ("verified", "a", 3, 2),
        ("extend", "a", (20,)),
        ("extend", "a", (21,)),
        ("extend", "a", (22,)),
    ]
    b = s.schedule()  # the next entry feeds the model's token
    assert b is not None and b.work[0].tokens[0] == 22 and b.work[0].start == 8


def test_a_stop_token_inside_the_accepted_run_ends_there_and_drops_the_rest() -> None:
    d = Replay({"a": CONT}, k=4)
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=8, drafter=d)
    s.add(req(stop_token_ids=frozenset({21})))
    run(s, [7])
    events = run(s, [20, 21, 22, 23, 24])  # all 4 accepted plus the bonus; 21 stops
    assert [(e.token, e.finish_reason) for e in events] == [(20, None), (21, "stop")]
    assert s.slots[0].session is None
    # the runner kept all five fed tokens: the slot says so (a recurrent state is there)
    assert s.slots[0].cached == [*PROMPT, 7, 20, 21, 22, 23]
    assert d.calls[-2:] == [("extend", "a", (21,)), ("finish", "a")]
    assert ("verified", "a", 4, 4) in d.calls


def test_drafts_never_pass_max_tokens_or_the_context_end() -> None:
    d = Replay({"a": CONT}, k=8)
    s = Scheduler(n_slots=1, n_ctx=64, batch_size=8, drafter=d)
    s.add(req(max_tokens=4))
    run(s, [7])
    b = s.schedule()
    assert b is not None and b.work[0].tokens == (7, 20, 21)  # tokens 2, 3 and 4 at most
    events = s.apply(answer(b, [20, 21, 22]))
    assert [(e.token, e.finish_reason) for e in events] == [(20, None), (21, None), (22, "length")]
    assert d.of("propose") == [("a", 1, 5, 2)]

    d = Replay({"a": CONT}, k=8)
    s = Scheduler(n_slots=1, n_ctx=9, batch_size=8, drafter=d)
    s.add(req())
    run(s, [7])
    b = s.schedule()  # 7 goes in at 5, drafts at 6, 7, 8: the context's last positions
    assert b is not None and b.work[0].tokens == (7, 20, 21, 22)
    events = s.apply(answer(b, [20, 21, 22, 23]))
    assert [e.finish_reason for e in events] == [None, None, None, "length"]
    assert s.slots[0].cached == [*PROMPT, 7, 20, 21, 22]


def test_no_drafts_where_the_request_or_its_reasoning_rules_them_out() -> None:
    think = ReasoningBudget(budget=3, open=(50,), close=(51,), forced=(51, 52), opened=True)
    cases = {
        "off": dict(speculative=False),
        "few": dict(draft_min=5),  # the drafter has 4 at most
        "max": dict(draft_max=2),
        "budget": dict(reasoning=think),  # 3 in the block: 1 written, rows up to 1 are free
        "open": dict(reasoning=ReasoningBudget(-1, (50,), (51,), (), True)),  # no budget
    }
    got = {}
    for name, kw in cases.items():
        d = Replay({"a": CONT}, k=4)
        s = Scheduler(n_slots=1, n_ctx=64, batch_size=8, drafter=d)
        s.add(req(**kw))
        run(s, [7])
        b = s.schedule()
        assert b is not None
        got[name] = b.work[0].n_draft
    assert got == {"off": 0, "few": 0, "max": 2, "budget": 1, "open": 4}


def test_an_aborted_verify_step_still_leaves_the_slot_as_the_runner_does() -> None:
    d = Replay({"a": CONT}, k=3)
    s = started(d)
    b = s.schedule()
    assert b is not None
    assert s.abort("a") is not None
    assert d.calls[-1] == ("finish", "a")
    assert s.apply(answer(b, [20, 99])) == []  # stale: no events, no drafter calls
    assert d.calls[-1] == ("finish", "a")
    assert s.slots[0].cached == [*PROMPT, 7, 20]


def test_only_steps_of_decode_rows_are_observed() -> None:
    d = Replay({"a": list(range(100, 140)), "b": CONT}, k=2)
    s = started(d)
    s.add(Request("b", list(range(30, 50)), GREEDY, 10))  # 20 tokens: chunks of 8, 8 and 4
    kinds = []
    for _ in range(5):
        b = s.schedule()
        assert b is not None
        kinds.append([(w.request_id, w.n_draft, w.sample) for w in b.work])
        # every draft accepted, then the bonus token 40; a prompt chunk gives 40 when it ends
        res = [[*w.tokens[1:], 40] if w.n_draft else [40] if w.sample else [] for w in b.work]
        s.apply(answer(b, *res, seconds=0.25))
        observed = d.of("observe")
        if any(r == "b" and n_sample for r, _, n_sample in kinds[-1]) and len(kinds) < 4:
            assert observed == [], kinds  # a prompt chunk rode the step
    assert kinds[:3] == [[("a", 2, True), ("b", 0, False)]] * 2 + [[("a", 2, True), ("b", 0, True)]]
    assert kinds[3:] == [[("a", 2, True), ("b", 2, True)]] * 2
    assert len(d.of("observe")) == 2  # the last two steps, decode rows only
    n_draft, depth, n_sessions = d.of("observe")[0]
    assert (n_draft, depth, n_sessions) == (2, 20, 2)  # b, 20 deep, is the deeper
    assert ("b", 2, 20, 8) in d.of("propose")  # two generating; b may still draft 10 - 1 - 1


def test_the_lane_schedulers_decode_batches_carry_drafts() -> None:
    d = Replay({"a": CONT}, k=3)
    s = LaneScheduler(n_slots=1, n_ctx=64, batch_size=8, drafter=d)
    s.add(req())
    lane = s.schedule_lane()
    assert lane is not None
    s.apply(answer(lane, [7]))
    b = s.schedule()
    assert b is not None and b.work[0].tokens == (7, 20, 21, 22) and b.work[0].n_draft == 3
