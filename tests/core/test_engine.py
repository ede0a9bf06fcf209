from __future__ import annotations

import asyncio

import pytest

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import (
    Request,
    SamplingParams,
    ScheduledBatch,
    StepResult,
    TokenEvent,
)
from mgserve.core.engine.stream import RequestStream
from tests.core.fake_model import FakeModel
from tests.prom import metric

GREEDY = SamplingParams(temperature=0.0)


def settings(**kw: int) -> Settings:
    base = dict(parallel=4, ctx_size=64, batch_size=8)
    return Settings(**{**base, **kw})  # type: ignore[arg-type]


async def collect(stream: RequestStream) -> list[TokenEvent]:
    return [ev async for ev in stream]


async def run_alone(model: FakeModel, r: Request) -> list[TokenEvent]:
    engine = Engine(model, settings(parallel=1))
    await engine.start()
    try:
        return await collect(engine.submit(r))
    finally:
        await engine.stop()


PROMPTS = [
    list(range(1, 20)),  # longer than batch_size: chunked beside the others' decoding
    [5, 6, 7],
    list(range(1, 12)),  # shares a prefix with the first
    [9],
]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=42)])
async def test_concurrent_requests_give_the_same_tokens_as_alone(sampling: SamplingParams) -> None:
    model = FakeModel(delay=0.002)
    reqs = [Request(f"r{i}", p, sampling, max_tokens=12) for i, p in enumerate(PROMPTS)]
    alone = [[e.token for e in await run_alone(model, r)] for r in reqs]

    engine = Engine(model, settings())
    await engine.start()
    model.calls.clear()
    together = await asyncio.gather(*(collect(engine.submit(r)) for r in reqs))
    await engine.stop()
    assert [[e.token for e in evs] for evs in together] == alone
    for evs in together:
        assert [e.n_generated for e in evs] == list(range(1, 13))
        assert evs[-1].finish_reason == "length"
    # each request's events name its one slot; four requests in four slots, one each
    slots = [{e.slot for e in evs} for evs in together]
    assert all(len(s) == 1 for s in slots) and set().union(*slots) == {0, 1, 2, 3}
    # the engine really batched: some forward carried several sessions
    assert max(len(c) for c in model.calls) == 4
    if sampling.greedy:
        assert alone == [model.greedy(p, 12) for p in PROMPTS]


async def test_prefix_reuse_gives_the_same_tokens() -> None:
    model = FakeModel()
    engine = Engine(model, settings(parallel=1))
    await engine.start()
    first = await collect(engine.submit(Request("a", list(range(1, 30)), GREEDY, 5)))
    second = await collect(engine.submit(Request("b", list(range(1, 25)) + [3], GREEDY, 5)))
    await engine.stop()
    assert first[0].n_cached == 0 and second[0].n_cached == 24
    assert [e.token for e in second] == model.greedy(list(range(1, 25)) + [3], 5)


async def test_abort_frees_the_slot_for_a_queued_request() -> None:
    model = FakeModel(delay=0.002)
    engine = Engine(model, settings(parallel=1))
    await engine.start()
    a = engine.submit(Request("a", [1, 2, 3], GREEDY, max_tokens=50))
    b = engine.submit(Request("b", [4, 5], GREEDY, max_tokens=3))
    got_a: list[TokenEvent] = []
    async for ev in a:
        got_a.append(ev)
        if len(got_a) == 2:
            a.abort()
            a.abort()  # idempotent
    assert got_a[-1].finish_reason == "abort" and got_a[-1].token is None
    assert len(got_a) < 50
    got_b = await asyncio.wait_for(collect(b), 5)
    assert [e.token for e in got_b] == model.greedy([4, 5], 3)
    assert engine.slots()[0]["is_processing"] is False
    await engine.stop()


async def test_a_request_id_in_use_is_refused_at_submit() -> None:
    engine = Engine(FakeModel(), settings(ctx_size=16))
    engine.submit(Request("a", [1], GREEDY, 1))
    with pytest.raises(ValueError, match="in use"):
        engine.submit(Request("a", [1], GREEDY, 1))
    await engine.stop()


async def test_the_engine_leaves_defaults_to_the_api() -> None:
    """A request comes resolved from the API (protocol.engine_request): the engine does not fill
    in --seed, so a request without a seed reaches the runner without one (random per session)."""
    model = FakeModel()
    engine = Engine(model, Settings(parallel=1, ctx_size=64, batch_size=8, seed=5))
    seen: list[int | None] = []
    runner = engine._runner
    run = runner.run

    def spy(batch: ScheduledBatch) -> StepResult:
        seen.extend(w.sampling.seed for w in batch.work)
        return run(batch)

    runner.run = spy  # type: ignore[method-assign]
    await engine.start()
    await collect(engine.submit(Request("a", [1, 2], GREEDY, 2)))
    await engine.stop()
    assert seen and set(seen) == {None}


async def test_a_failing_step_errors_its_requests_and_the_engine_keeps_serving() -> None:
    model = FakeModel()
    model.fail_token = 13
    engine = Engine(model, settings())
    await engine.start()
    bad = await collect(engine.submit(Request("bad", [1, 13], GREEDY, 4)))
    assert bad[-1].finish_reason == "error" and "fake failure" in (bad[-1].error or "")
    good = await collect(engine.submit(Request("good", [1, 2], GREEDY, 4)))
    assert [e.token for e in good] == model.greedy([1, 2], 4)
    await engine.stop()


async def test_eog_stops_and_metrics_count() -> None:
    model = FakeModel()
    eog = model.greedy([3, 4], 3)[2]
    engine = Engine(model, settings())
    await engine.start()
    r = Request("a", [3, 4], GREEDY, max_tokens=10, stop_token_ids=frozenset({eog}))
    evs = await collect(engine.submit(r))
    want = model.greedy([3, 4], 3)
    want = want[: want.index(eog) + 1]  # eog may come even before the third token
    assert [e.token for e in evs] == want
    assert evs[-1].finish_reason == "stop" and [e.finish_reason for e in evs[:-1]] == [None] * (
        len(evs) - 1
    )
    reg = engine.metrics.registry
    assert metric(reg, "llamacpp:tokens_predicted_total") == len(evs)
    assert metric(reg, "llamacpp:prompt_tokens_total") == 2
    assert metric(reg, "mgserve_requests_total", finish_reason="stop") == 1
    assert metric(reg, "mgserve_requests_submitted_total") == 1
    assert metric(reg, "mgserve_time_to_first_token_seconds_count") == 1
    assert metric(reg, "mgserve_inter_token_latency_seconds_count") == len(evs) - 1
    # one step for the prompt (which samples the first token), one per later token
    assert metric(reg, "llamacpp:n_decode_total") == len(evs)
    assert metric(reg, "mgserve_step_seconds_count", phase="prefill") == 1
    assert metric(reg, "mgserve_step_seconds_count", phase="decode") == len(evs) - 1
    assert metric(reg, "llamacpp:n_busy_slots_per_decode") == 1
    assert metric(reg, "llamacpp:n_tokens_max") == 2 + len(evs) - 1  # the last token is not fed
    assert metric(reg, "llamacpp:requests_processing") == 0
    assert engine.stats["total_slots"] == 4 and engine.n_ctx == 64
    await engine.stop()


async def test_each_engine_counts_its_own() -> None:
    a, b = Engine(FakeModel(), settings()), Engine(FakeModel(), settings())
    await a.start()
    await collect(a.submit(Request("x", [1, 2, 3], GREEDY, 2)))
    assert metric(a.metrics.registry, "llamacpp:prompt_tokens_total") == 3
    assert metric(b.metrics.registry, "llamacpp:prompt_tokens_total") == 0
    await a.stop()
    await b.stop()


async def test_stop_aborts_requests_in_flight() -> None:
    engine = Engine(FakeModel(delay=0.01), settings(parallel=1))
    await engine.start()
    a = engine.submit(Request("a", [1], GREEDY, 50))
    b = engine.submit(Request("b", [2], GREEDY, 50))
    first = await a.__anext__()
    assert first.token is not None
    await engine.stop()
    rest_a = await asyncio.wait_for(collect(a), 1)
    rest_b = await asyncio.wait_for(collect(b), 1)
    assert rest_a[-1].finish_reason == "abort" and rest_b == [rest_b[-1]]
    assert rest_b[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError):
        engine.submit(Request("c", [1], GREEDY, 1))
