"""The engine's admission and cancellation: a bounded queue, and a request that ends (max_tokens,
a stop token, an abort: what a stop string or a disconnect sends) leaves its slot at once, on the
reference engine with a tiny llama; prompt progress; a pinned slot and reuse switched off."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams, ScheduledBatch, StepResult
from mgserve.core.engine.stream import QueueFull, RequestStream
from mgserve.core.models import load_model
from tests.core import tiny
from tests.core.fake_model import FakeModel
from tests.prom import metric

GREEDY = SamplingParams(temperature=0.0)
PROMPT = list(range(3, 43))  # 40 tokens: 5 chunks of --batch-size 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Any:
    path: Path = tmp_path_factory.mktemp("m") / "llama.gguf"
    return load_model(tiny.export(tiny.hf_model("llama"), "llama", path), threads=1)


def engine_of(model: Any, **kw: Any) -> Engine:
    return Engine(model, Settings(**{"parallel": 2, "ctx_size": 128, "batch_size": 8} | kw))


def spy_steps(engine: Engine) -> list[tuple[int, set[str]]]:
    """(step, request ids) of every batch the runner runs."""
    seen: list[tuple[int, set[str]]] = []
    run = engine._runner.run

    def spy(batch: ScheduledBatch) -> StepResult:
        seen.append((batch.step, {w.request_id for w in batch.work}))
        return run(batch)

    engine._runner.run = spy  # type: ignore[method-assign]
    return seen


def idle(engine: Engine) -> bool:
    """No slot busy, nothing queued, no request open."""
    free = not any(s["is_processing"] for s in engine.slots())
    return free and engine._sched.n_busy == 0 and not engine._sched.queue and not engine._streams


async def test_the_queue_is_bounded_and_an_aborted_request_leaves_it_at_once() -> None:
    engine = engine_of(FakeModel(), parallel=1, max_queue=2)
    a, b, c = (engine.submit(Request(r, [1, 2], GREEDY, 3)) for r in "abc")  # a slot + 2 waiting
    assert engine.waiting == 2
    with pytest.raises(QueueFull, match="2 requests are already waiting") as e:
        engine.submit(Request("d", [1], GREEDY, 1))
    assert 1 <= e.value.retry_after <= 60
    assert metric(engine.metrics.registry, "mgserve_requests_rejected_total") == 1
    c.abort()  # still queued: its place frees now, not after a step
    assert engine.waiting == 1 and [ev.finish_reason async for ev in c] == ["abort"]
    d = engine.submit(Request("d", [1], GREEDY, 1))
    await engine.start()
    for s in (a, b, d):
        assert [ev.finish_reason async for ev in s][-1] == "length"
    assert idle(engine)
    await engine.stop()


async def test_max_queue_0_refuses_whatever_finds_no_free_slot() -> None:
    engine = engine_of(FakeModel(), parallel=2, max_queue=0)
    engine.submit(Request("a", [1], GREEDY, 1))
    engine.submit(Request("b", [1], GREEDY, 1))
    with pytest.raises(QueueFull):
        engine.submit(Request("c", [1], GREEDY, 1))
    await engine.stop()


async def test_max_tokens_and_a_stop_token_free_the_slot_with_the_last_event(llama: Any) -> None:
    engine = engine_of(llama)
    await engine.start()
    want = [ev.token async for ev in engine.submit(Request("probe", PROMPT, GREEDY, 4))]
    stop = frozenset({want[1]})
    for r in (Request("len", PROMPT, GREEDY, 3), Request("eog", PROMPT, GREEDY, 9, stop)):
        async for ev in engine.submit(r):
            if ev.finish_reason is not None:
                assert ev.finish_reason == ("length" if r.id == "len" else "stop")
                assert idle(engine)  # already when the last event arrives
    await engine.stop()


@pytest.mark.parametrize("where", ["prompt", "decode"])
async def test_abort_frees_the_slot_at_once_and_no_later_step_runs_it(
    llama: Any, where: str
) -> None:
    engine = engine_of(llama)
    steps = spy_steps(engine)
    await engine.start()
    other = engine.submit(Request("other", [5, 6, 7], GREEDY, 12, ignore_eos=True))
    stream = engine.submit(Request("a", PROMPT, GREEDY, 50, ignore_eos=True, progress=True))
    async for ev in stream:
        mid_prompt = ev.progress is not None and 0 < ev.progress.processed < len(PROMPT)
        if (where == "prompt" and mid_prompt) or (where == "decode" and ev.n_generated == 2):
            planned = engine._sched._step  # the step in flight (if any) is the last with "a"
            stream.abort()
            assert not any(s["id_task"] == "a" for s in engine.slots())
            assert engine._sched.n_busy == 1  # "other" runs on
            break
    assert [ev.finish_reason async for ev in stream] == ["abort"]
    await asyncio.wait_for(_drain(other), 10)
    assert max(step for step, ids in steps if "a" in ids) <= planned
    assert idle(engine)
    await engine.stop()


async def _drain(stream: RequestStream) -> None:
    async for _ in stream:
        pass


async def test_prompt_progress_after_each_chunk(llama: Any) -> None:
    engine = engine_of(llama)
    await engine.start()
    cold = [ev async for ev in engine.submit(Request("a", PROMPT, GREEDY, 2, progress=True))]
    progress = [ev.progress for ev in cold if ev.progress is not None]
    assert [p.processed for p in progress] == [0, 8, 16, 24, 32, 40]
    assert {(p.total, p.cache) for p in progress} == {(40, 0)}
    assert [p.time_ms for p in progress] == sorted(p.time_ms for p in progress)
    assert cold[: len(progress)] == [ev for ev in cold if ev.progress]  # all before the tokens
    assert all(ev.token is None and ev.finish_reason is None for ev in cold if ev.progress)
    assert {ev.slot for ev in cold} == {cold[-1].slot}
    # the prefix is reused: progress starts past it (20 tokens, chunks cut from there)
    warm = engine.submit(Request("b", PROMPT[:20] + [99] * 10, GREEDY, 2, progress=True))
    progress = [ev.progress async for ev in warm if ev.progress is not None]
    assert [(p.cache, p.processed) for p in progress] == [(20, 20), (20, 28), (20, 30)]
    # without progress=True, no progress events
    plain = [ev async for ev in engine.submit(Request("c", PROMPT, GREEDY, 2))]
    assert all(ev.token is not None for ev in plain)
    await engine.stop()


async def test_a_pinned_slot_and_reuse_off_give_the_same_tokens(llama: Any) -> None:
    engine = engine_of(llama)
    await engine.start()
    base = [ev async for ev in engine.submit(Request("a", PROMPT, GREEDY, 5))]
    pinned = [ev async for ev in engine.submit(Request("b", PROMPT, GREEDY, 5, slot=1))]
    cold = [ev async for ev in engine.submit(Request("c", PROMPT, GREEDY, 5, reuse_prefix=False))]
    warm = [ev async for ev in engine.submit(Request("d", PROMPT, GREEDY, 5))]
    assert {ev.slot for ev in pinned} == {1} and base[0].slot == 0
    assert cold[0].n_cached == 0 and warm[0].n_cached == len(PROMPT) - 1
    tokens = [[ev.token for ev in evs] for evs in (base, pinned, cold, warm)]
    assert tokens[1:] == [tokens[0]] * 3
    assert idle(engine)
    await engine.stop()


class _Letters:
    """A detokenizer that writes each token as one letter, so any output is text."""

    @staticmethod
    def text(tokens: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in tokens)

    def push(self, token: int) -> str:
        return self.text([token])

    def flush(self) -> str:
        return ""


async def test_a_stop_string_frees_the_slot_with_the_last_chunk(llama: Any) -> None:
    from mgserve.api.generate import Generation
    from mgserve.api.protocol import GenParams
    from tests.api.conftest import fake_service

    engine = engine_of(llama)
    service = fake_service(engine=engine)
    service.new_detokenizer = lambda keep: _Letters()
    await engine.start()
    probe = [ev.token async for ev in engine.submit(Request("probe", PROMPT, GREEDY, 8))]
    stop = _Letters.text(probe[4:6])  # type: ignore[arg-type]
    params = GenParams(GREEDY, 40, (stop,), False, True, False)
    with Generation(service, Request("a", PROMPT, GREEDY, 40), params) as gen:
        async for c in gen.chunks():
            if c.finish_reason is not None:
                assert c.finish_reason == "stop" and idle(engine)  # aborted in the engine
    assert gen.stop_word == stop and gen.n_generated <= 6
    done = engine.metrics.registry
    assert metric(done, "mgserve_requests_total", finish_reason="stop") == 1  # not a cancellation
    assert metric(done, "mgserve_requests_total", finish_reason="abort") == 0
    await engine.stop()


async def test_retry_after_follows_how_long_requests_hold_a_slot() -> None:
    engine = engine_of(FakeModel(delay=0.01), parallel=2, max_queue=0)
    await engine.start()
    assert engine._retry_after() == 1  # nothing measured yet
    await _drain(engine.submit(Request("a", [1, 2], GREEDY, 4)))
    assert engine._slot_s is not None and 0.03 < engine._slot_s < 5  # about 4 steps of 10 ms
    engine._slot_s = 30.0  # requests holding a slot 30 s, two slots: one ends every ~15 s
    assert engine._retry_after() == 15
    engine._slot_s = 1e4
    assert engine._retry_after() == 60
    await engine.stop()


async def test_random_aborts_on_a_hybrid_leave_no_slot_busy_and_no_checkpoint_behind(
    tmp_path: Path, one_thread: None
) -> None:
    """Forty requests on a tiny qwen3next with checkpoints, aborted at random points (queued, mid
    prompt with a chunk on the runner, mid decode), some pinned, some reusing nothing."""
    from tests.core import hybrid_export

    path = hybrid_export.export(hybrid_export.hf_model("qwen3next"), "qwen3next", tmp_path / "m")
    model = load_model(path, threads=1)
    kw = {"ctx_checkpoints": 2, "checkpoint_every": 16, "cache_ram": 1}
    engine = engine_of(model, **kw)
    rng = random.Random(5)
    base = [3 + (i * 37) % 140 for i in range(60)]

    async def one(i: int) -> None:
        prompt = base[: rng.randint(10, 60)] + [rng.randint(3, 150)]
        slot = rng.choice([None, None, 0, 1])
        r = Request(f"r{i}", prompt, GREEDY, 8, slot=slot, reuse_prefix=rng.random() < 0.7)
        stream = engine.submit(dataclasses.replace(r, progress=True))
        stop_at = rng.randint(0, 12)  # events before the abort (12: none, it runs to its end)
        n = 0
        async for _ in stream:
            n += 1
            if n == stop_at:
                stream.abort()
        await asyncio.sleep(0)

    await engine.start()
    await asyncio.gather(*(one(i) for i in range(40)))
    assert idle(engine)
    book, store = engine._sched.checkpoints, engine._runner.checkpoints  # type: ignore[attr-defined]
    assert set(store.held) == set(book.held)  # the runner holds exactly what the book counts
    on_device = [slot for (slot, _), on_host in book.held.items() if not on_host]
    assert all(on_device.count(s) <= book.per_slot for s in range(2))
    assert book.nbytes_in(host=True) <= book.host_bytes
    prompt = base[:45]
    fresh = await _fresh_tokens(model, prompt)
    assert await _tokens_of(engine, Request("end", prompt, GREEDY, 6, reuse_prefix=False)) == fresh
    await engine.stop()


async def _tokens_of(engine: Engine, r: Request) -> list[int | None]:
    return [ev.token async for ev in engine.submit(r)]


async def _fresh_tokens(model: Any, prompt: list[int]) -> list[int | None]:
    engine = engine_of(model, parallel=1)
    await engine.start()
    try:
        return await _tokens_of(engine, Request("fresh", prompt, GREEDY, 6))
    finally:
        await engine.stop()
