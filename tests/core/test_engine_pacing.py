"""The engine with --itl-target-ms on real tiny models (dense, and the recurrent qwen3next and
qwen4exp): a prompt computed in pieces beside two decoders gives the same greedy tokens and
logprobs (bitwise) as with no target, for every session, and the actor feeds the scheduler's cost
model its step times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mgserve.config import Settings, settings_from
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.pacing import QUANTUM
from mgserve.core.models import load_model
from tests.core.conftest import require_chunk_invariance
from tests.core.mixed_load import Out, serve

DATA = Path(__file__).resolve().parent.parent / "data"
N_PROMPT = 300  # chunks [0, 256) and [256, 300) of --batch-size 256; pieces of 64 with a target


@pytest.fixture(scope="module", params=["llama", "qwen3next", "qwen4exp"])
def model(request: pytest.FixtureRequest, one_thread: None) -> Any:
    return load_model(DATA / f"converted_{request.param}.gguf", threads=1)


async def _serve(model: Any, target_ms: int) -> tuple[Out, list[int], Engine]:
    settings = Settings(parallel=3, ctx_size=512, batch_size=256, itl_target_ms=target_ms)
    engine = Engine(model, settings)
    out, chunks = await serve(engine, N_PROMPT, 60)
    return out, chunks, engine


async def test_pieces_beside_decoders_give_the_bits_of_whole_chunks(model: Any) -> None:
    require_chunk_invariance(model)
    whole, whole_works, _ = await _serve(model, 0)
    # 1 ms: less than a decode step takes, so each step carries at most a piece
    paced, paced_works, engine = await _serve(model, 1)
    assert whole_works[:2] == [256, N_PROMPT - 256]
    assert paced_works[:4] == [QUANTUM] * 4  # [0, 256) in pieces, beside the decoders
    assert paced == whole
    assert [len(t) for t in paced.values()] == [60, 60, 4]
    assert engine._sched.pacer.cost.fit(2) is not None  # the actor reported its step times


def test_the_settings_are_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MGSERVE_ITL_TARGET_MS", "40")
    monkeypatch.setenv("MGSERVE_PREFILL_SESSIONS", "2")
    s = settings_from()
    assert (s.itl_target_ms, s.prefill_sessions) == (40, 2)
    with pytest.raises(ValueError, match="itl-target-ms must be >= 0"):
        Settings(itl_target_ms=-1)
    with pytest.raises(ValueError, match="prefill-sessions must be >= 0"):
        Settings(prefill_sessions=-1)
