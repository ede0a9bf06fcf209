"""Reasoning budgets (mgserve/core/engine/reasoning.py): the tracker on hand-written token
sequences, the scheduler's forced draws and grammar hand-over, and the engine on the fake model:
a budget of k gives exactly k reasoning tokens, then the close marker, then the answer, alone or
beside other sessions; stop tokens and max_tokens still end a request; a grammar starts after the
close (the vocabulary and schema of test_grammar.py)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams, TokenEvent
from mgserve.core.engine.reasoning import ReasoningBudget, ReasoningTracker
from mgserve.core.engine.scheduler import Scheduler
from tests.core.fake_model import FakeModel
from tests.core.test_grammar import N_VOCAB, SCHEMA, compiler, tokenizer
from tests.core.test_scheduler import answer

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, seed=7)
CLOSE = (60, 47, 62)  # "</>" in test_grammar's vocabulary; the fake model's greedy never writes it
FORCED = (*CLOSE, 10, 10)  # the close marker, then a blank line


def budget(k: int, opened: bool = True, open_: tuple[int, ...] = (90, 91)) -> ReasoningBudget:
    return ReasoningBudget(k, open_, CLOSE, FORCED, opened)


def drive(t: ReasoningTracker, tokens: list[int]) -> list[int | None]:
    """Feed ``tokens`` one at a time; what the tracker forced before each."""
    out = []
    for tok in tokens:
        out.append(t.forced())
        t.feed(tok)
    return out


# -- the tracker ---------------------------------------------------------------------------------


def test_an_opened_block_is_closed_after_k_tokens() -> None:
    t = ReasoningTracker(budget(3), constrained=False)
    assert drive(t, [1, 2, 3, *FORCED, 4]) == [None, None, None, *FORCED, None]
    assert t.closed and t.n == 3


def test_budget_zero_forces_at_once_and_minus_one_never() -> None:
    t = ReasoningTracker(budget(0), constrained=False)
    assert drive(t, list(FORCED)) == list(FORCED) and t.closed
    t = ReasoningTracker(budget(-1), constrained=False)
    assert drive(t, list(range(100, 140))) == [None] * 40 and not t.closed
    t.feed(CLOSE[0])
    t.feed(CLOSE[1])
    assert not t.closed
    t.feed(CLOSE[2])
    assert t.closed and t.n == 42  # the marker's tokens before its last count as reasoning


def test_the_model_closing_first_ends_the_block() -> None:
    t = ReasoningTracker(budget(5), constrained=False)
    assert drive(t, [1, *CLOSE, 2, 3, 4, 5, 6, 7]) == [None] * 10
    assert t.closed


def test_a_block_the_model_opens() -> None:
    t = ReasoningTracker(budget(2, opened=False), constrained=False)
    assert drive(t, [90, 91, 1, 2, *FORCED]) == [None] * 4 + list(FORCED)
    t = ReasoningTracker(budget(2, opened=False), constrained=False)
    drive(t, [90, 5])  # not the open marker: there is no block
    assert t.closed and t.forced() is None
    # under a grammar only the prompt can open a block: none is expected from the model
    assert ReasoningTracker(budget(2, opened=False), constrained=True).closed
    assert not ReasoningTracker(budget(2), constrained=True).closed


# -- the scheduler -------------------------------------------------------------------------------


def test_the_scheduler_forces_the_close_and_then_hands_over_the_grammar() -> None:
    grammar = compiler().json_schema(SCHEMA)
    s = Scheduler(n_slots=2, n_ctx=64, batch_size=16)
    s.add(Request("a", [1, 2, 3], GREEDY, 20, grammar=grammar, reasoning=budget(2)))
    s.add(Request("b", [4, 5], GREEDY, 20, grammar=grammar))
    seen = []
    for _ in range(7):
        b = s.schedule()
        assert b is not None
        seen.append({w.request_id: (w.force, w.grammar is not None) for w in b.work})
        forced = {f"s{w.slot}": w.force for w in b.work if w.force is not None}
        s.apply(answer(b, 7, **forced))  # type: ignore[arg-type]
    a = [x["a"] for x in seen]
    assert a == [(None, False), (None, False), *((f, False) for f in FORCED)]
    b8 = s.schedule()
    assert b8 is not None and [(w.force, w.grammar is not None) for w in b8.work] == [
        (None, True),  # a: the block is closed, the grammar starts with this draw
        (None, False),
    ]
    assert [x["b"] for x in seen] == [(None, True)] + [(None, False)] * 6  # from its first draw


# -- the engine ----------------------------------------------------------------------------------


async def serve(model: FakeModel, reqs: list[Request], parallel: int = 4) -> list[list[TokenEvent]]:
    engine = Engine(model, Settings(parallel=parallel, ctx_size=192, batch_size=8))
    await engine.start()
    try:
        return list(
            await asyncio.gather(*(_events(engine.submit(r)) for r in reqs))  # type: ignore[arg-type]
        )
    finally:
        await engine.stop()


async def _events(stream: object) -> list[TokenEvent]:
    return [ev async for ev in stream]  # type: ignore[attr-defined]


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [e.token for e in evs if e.token is not None]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
@pytest.mark.parametrize("k", [0, 1, 4])
async def test_a_budget_of_k_gives_k_reasoning_tokens_then_the_close(
    sampling: SamplingParams, k: int
) -> None:
    model = FakeModel()
    prompt = [5, 6, 7, 8]
    req = Request("a", prompt, sampling, max_tokens=k + len(FORCED) + 6, reasoning=budget(k))
    (alone,) = await serve(model, [req], parallel=1)
    got = tokens(alone)
    assert got[k : k + len(FORCED)] == list(FORCED) and len(got) == k + len(FORCED) + 6
    assert alone[-1].finish_reason == "length"
    if sampling.greedy:  # free before and after: the model's own greedy choices
        assert got[:k] == model.greedy(prompt, k)
        assert got[k + len(FORCED) :] == model.greedy(prompt + got[: k + len(FORCED)], 6)
    # beside other sessions (one of them also budgeted), the same tokens: forcing is per row
    others = [
        Request("b", list(range(1, 20)), SAMPLED, 12),
        Request("c", [9, 9, 9], GREEDY, 14, reasoning=budget(2)),
    ]
    together = await serve(model, [req, *others])
    assert tokens(together[0]) == got
    assert tokens(together[1]) == tokens((await serve(model, others[:1]))[0])
    assert tokens(together[2])[2:7] == list(FORCED)


async def test_a_block_the_model_opens_itself() -> None:
    model = FakeModel()
    prompt = [5, 6, 7, 8]
    first = model.greedy(prompt, 1)
    req = Request("a", prompt, GREEDY, 12, reasoning=budget(2, opened=False, open_=tuple(first)))
    got = tokens((await serve(model, [req]))[0])
    assert got[:3] == model.greedy(prompt, 3) and got[3:8] == list(FORCED)


async def test_stop_tokens_and_max_tokens_still_end_the_reasoning() -> None:
    model = FakeModel()
    prompt = [5, 6, 7, 8]
    free = model.greedy(prompt, 3)
    stop = Request("s", prompt, GREEDY, 40, frozenset({free[2]}), reasoning=budget(10))
    short = Request("m", prompt, GREEDY, 5, reasoning=budget(3))  # ends inside the forced close
    evs_stop, evs_short = await serve(model, [stop, short])
    assert tokens(evs_stop) == free and evs_stop[-1].finish_reason == "stop"
    assert tokens(evs_short) == free + list(FORCED[:2]) and evs_short[-1].finish_reason == "length"


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
async def test_a_grammar_starts_after_the_close(sampling: SamplingParams) -> None:
    tok = tokenizer()
    model = FakeModel(n_vocab=N_VOCAB)
    req = Request(
        "g",
        [5, 6, 7, 8],
        sampling,
        max_tokens=120,
        stop_token_ids=frozenset(tok.eog_ids),
        grammar=compiler().json_schema(SCHEMA),
        reasoning=budget(3),
    )
    (evs,) = await serve(model, [req])
    got = tokens(evs)
    assert got[3:8] == list(FORCED) and evs[-1].finish_reason == "stop"
    if sampling.greedy:
        assert got[:3] == model.greedy([5, 6, 7, 8], 3)  # unconstrained while reasoning
    answer_ids = got[8:-1]
    jsonschema.validate(json.loads(b"".join(tok.piece(t) for t in answer_ids)), SCHEMA)
