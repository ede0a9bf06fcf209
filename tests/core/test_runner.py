from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
from mgserve.core.engine.runner import ReferenceRunner
from tests.core.fake_model import FakeModel

GREEDY = SamplingParams(temperature=0.0)


def work(slot: int, tokens: tuple[int, ...], start: int, **kw: object) -> SeqWork:
    fields = dict(request_id=f"r{slot}", sample=True, sampling=GREEDY)
    return SeqWork(slot=slot, tokens=tokens, start=start, **{**fields, **kw})  # type: ignore[arg-type]


def test_one_forward_per_step_and_rows_go_to_their_slots() -> None:
    model = FakeModel()
    runner = ReferenceRunner(model, n_slots=3, n_ctx=32)
    batch = ScheduledBatch(
        1,
        (
            work(0, (1, 2, 3), 0, new_sequence=True),
            work(1, (4, 5), 0, new_sequence=True, sample=False),
            work(2, (6,), 0, new_sequence=True),
        ),
    )
    res = runner.run(batch)
    assert model.calls == [[(0, 3, 1), (0, 2, 0), (0, 1, 1)]]
    assert res.n_tokens == 6 and res.step == 1
    assert [(r.slot, r.request_id) for r in res.results] == [(0, "r0"), (2, "r2")]
    assert [r.token for r in res.results] == [
        model.greedy([1, 2, 3], 1)[0],
        model.greedy([6], 1)[0],
    ]


def test_penalty_window_holds_the_cached_prefix_and_every_fed_token() -> None:
    runner = ReferenceRunner(FakeModel(), n_slots=1, n_ctx=32)
    p = SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=-1)
    runner.run(
        ScheduledBatch(1, (work(0, (1, 2), 0, sampling=p, sample=False, new_sequence=True),))
    )
    runner.run(ScheduledBatch(2, (work(0, (3,), 2, sampling=p),)))
    # a new request reusing positions 0..1: its window starts from the history the scheduler gives
    runner.run(
        ScheduledBatch(3, (work(0, (9,), 2, sampling=p, new_sequence=True, history=(1, 2)),), (0,))
    )
    assert runner._samplers[0].window.counts == Counter({1: 1, 2: 1, 9: 1})


def test_logprobs_are_reported_when_asked() -> None:
    model = FakeModel()
    runner = ReferenceRunner(model, n_slots=1, n_ctx=32)
    p = SamplingParams(temperature=0.0, want_logprob=True, n_probs=3)
    (r,) = runner.run(
        ScheduledBatch(1, (work(0, (1, 2), 0, sampling=p, new_sequence=True),))
    ).results
    lp = torch.log_softmax(model.logits_at(model.context_hash([1, 2])), dim=-1)  # from scratch
    assert r.token == int(lp.argmax()) and r.logprob == pytest.approx(float(lp.max()))
    assert [t.token for t in r.top] == lp.topk(3).indices.tolist()


@pytest.mark.slow
def test_gemma_through_the_runner_matches_a_plain_greedy_loop(gemma_path: Path) -> None:
    from mgserve.core.models import SeqInput, load_model

    model = load_model(gemma_path)
    prompt = [2, 651, 6037, 529, 7001, 563]
    n = 4
    cache = model.new_cache(32)
    want: list[int] = []
    logits = model.forward([SeqInput(cache, torch.tensor(prompt), 0, 1)])
    for i in range(n):
        want.append(int(logits[0].argmax()))
        pos = len(prompt) + i
        logits = model.forward([SeqInput(cache, torch.tensor(want[-1:]), pos, 1)])

    runner = ReferenceRunner(model, n_slots=1, n_ctx=32)
    got: list[int] = []
    tokens, start = tuple(prompt), 0
    for step in range(n):
        w = work(0, tokens, start, new_sequence=step == 0)
        got.append(runner.run(ScheduledBatch(step + 1, (w,))).results[0].token)
        start += len(tokens)
        tokens = (got[-1],)
    assert got == want
