"""The engine actor with a prefill lane (core/engine/lanes.py) on the CPU: the reference runner
behind a fake with ``lanes``, whose prompt chunks complete asynchronously (a lane batch returns
only after the decoders' thread has finished ``LAG`` batches since it began). On tiny dense and
recurrent models: two sessions decode while a third's long prompt is chunked in the lane, each
decode batch carrying both decoders while a chunk is in flight, the chunks cut where they are
without the lane, and every request's tokens and logprobs bitwise those of the sequential engine;
a chunk that fails ends only its request."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mgserve.config import Settings, settings_from
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import ScheduledBatch, StepResult
from mgserve.core.engine.runner import ReferenceRunner
from mgserve.core.models import load_model
from tests.core.mixed_load import LANE_CHUNKS, LANE_DECODE, LANE_PROMPT, LANE_SETTINGS, Out, serve

DATA = Path(__file__).resolve().parent.parent / "data"
LAG = 2  # decode batches a lane batch waits for


@pytest.fixture(scope="module", params=["llama", "qwen3next", "qwen4exp"])
def model(request: pytest.FixtureRequest, one_thread: None) -> Any:
    return load_model(DATA / f"converted_{request.param}.gguf", threads=1)


class LaneRunner:
    """The reference runner, one batch at a time, with lane batches held back until ``LAG``
    decode batches have completed since they began (at most ``wait`` seconds: nobody may be
    decoding). ``log``: (lane, step, sessions, start, end) per batch, in perf_counter seconds."""

    lanes = True

    def __init__(self, inner: ReferenceRunner, wait: float = 0.5, fail: str = "") -> None:
        self.inner, self.wait, self.fail = inner, wait, fail
        self.checkpoint_nbytes, self.slot_format = inner.checkpoint_nbytes, inner.slot_format
        self.log: list[tuple[bool, int, tuple[str, ...], float, float]] = []
        self._model = threading.Lock()
        self._decoded = threading.Condition()
        self._n_decoded = 0

    def run(self, batch: ScheduledBatch) -> StepResult:
        t0 = time.perf_counter()
        n0 = self._n_decoded
        with self._model:
            if any(w.request_id == self.fail for w in batch.work):
                raise RuntimeError("the lane failed")
            result = self.inner.run(batch)
        with self._decoded:
            if batch.lane:
                self._decoded.wait_for(lambda: self._n_decoded >= n0 + LAG, self.wait)
            else:
                self._n_decoded += 1
                self._decoded.notify_all()
        ids = tuple(w.request_id for w in batch.work)
        self.log.append((batch.lane, batch.step, ids, t0, time.perf_counter()))
        return result


async def _serve(model: Any, lanes: bool, fail: str = "") -> tuple[Out, list[int], Any]:
    ref = ReferenceRunner(model, LANE_SETTINGS.parallel, LANE_SETTINGS.ctx_size)
    runner = LaneRunner(ref, fail=fail) if lanes else ref
    engine = Engine(model, LANE_SETTINGS, runner=runner)  # type: ignore[arg-type]
    assert engine.lanes == lanes
    out, chunks = await serve(engine, LANE_PROMPT, LANE_DECODE)
    return out, chunks, runner


async def test_decoders_stream_while_the_lane_computes_the_prompt(model: Any) -> None:
    seq, seq_works, _ = await _serve(model, lanes=False)
    got, works, runner = await _serve(model, lanes=True)
    assert works == seq_works == LANE_CHUNKS  # the same chunks, the last token alone
    assert got == seq
    assert [len(t) for t in got.values()] == [LANE_DECODE, LANE_DECODE, 4]
    chunks = [(t0, t1) for lane, _, ids, t0, t1 in runner.log if lane and "p" in ids]
    assert len(chunks) == 6
    for t0, t1 in chunks:  # every chunk in flight across LAG decode batches of both decoders
        beside = [ids for lane, _, ids, _, s1 in runner.log if not lane and t0 <= s1 <= t1]
        assert len(beside) >= LAG and all(sorted(ids) == ["d0", "d1"] for ids in beside)


async def test_a_failed_chunk_ends_only_its_request(model: Any) -> None:
    seq, _, _ = await _serve(model, lanes=False)
    got, _, _ = await _serve(model, lanes=True, fail="p")
    assert got["p"] == [(None, None)]  # the error event
    assert {k: v for k, v in got.items() if k != "p"} == {k: v for k, v in seq.items() if k != "p"}


def test_the_setting_is_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().prefill_lane == "auto"
    monkeypatch.setenv("MGSERVE_PREFILL_LANE", "on")
    assert settings_from().prefill_lane == "on"
    with pytest.raises(ValueError, match="prefill_lane must be one of"):
        Settings(prefill_lane="yes")


def test_auto_runs_the_lane_where_it_helps() -> None:
    """``--prefill-lane auto`` (the default): on for a GPU server of several slots, off for one
    slot, for virtual stages and with a latency target; on and off are what they say."""
    from mgserve.core.engine.factory import prefill_lane

    assert prefill_lane(Settings(parallel=4))
    assert not prefill_lane(Settings(parallel=1))
    assert not prefill_lane(Settings(parallel=4, virtual_stages=2))
    assert not prefill_lane(Settings(parallel=4, itl_target_ms=30))
    assert prefill_lane(Settings(parallel=1, prefill_lane="on"))
    assert not prefill_lane(Settings(parallel=4, prefill_lane="off"))
