"""/metrics and /slots on the tiny converted qwen3next (a hybrid model: prefix reuse through
recurrent-state checkpoints): llama-server's names and values for a few requests, prompt tokens
counted once, reused tokens counted on a second turn and an edited one, and /slots showing each
slot's depth and the checkpoints it holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.http import SERVICE
from mgserve.api.service import Service, build_service
from mgserve.config import Settings
from tests.prom import metric

pytestmark = pytest.mark.asyncio(loop_scope="module")
FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen3next.gguf"
# chunks of 16 tokens; a checkpoint at every multiple of 32 and at the last chunk end before a
# prompt's end
SETTINGS = Settings(
    model=str(FILE), ctx_size=128, parallel=2, device="cpu", batch_size=16, checkpoint_every=32
)
A = [10 + (7 * i) % 180 for i in range(40)]
N = 4  # tokens per answer
GREEDY = {"n_predict": N, "temperature": 0, "ignore_eos": True, "return_tokens": True}


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    yield build_service(SETTINGS)


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def _scrape(client: TestClient[Any, Any]) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return await resp.text()


async def test_a_fresh_server_exposes_llama_server_names_at_zero(
    client: TestClient[Any, Any],
) -> None:
    text = await _scrape(client)
    for name, kind in [
        ("llamacpp:prompt_tokens_total", "counter"),
        ("llamacpp:prompt_seconds_total", "counter"),
        ("llamacpp:tokens_predicted_total", "counter"),
        ("llamacpp:tokens_predicted_seconds_total", "counter"),
        ("llamacpp:n_decode_total", "counter"),
        ("llamacpp:prompt_tokens_seconds", "gauge"),
        ("llamacpp:predicted_tokens_seconds", "gauge"),
        ("llamacpp:n_busy_slots_per_decode", "gauge"),
        ("llamacpp:requests_processing", "gauge"),
        ("llamacpp:requests_deferred", "gauge"),
        ("mgserve_time_to_first_token_seconds", "histogram"),
        ("mgserve_step_seconds", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text
    assert metric(text, "llamacpp:prompt_tokens_total") == 0
    assert metric(text, "mgserve_slots_total") == 2
    assert metric(text, "mgserve_requests_total", finish_reason="abort") == 0


async def test_prompt_and_reused_tokens_over_three_turns(client: TestClient[Any, Any]) -> None:
    first = await (await client.post("/completion", json={"prompt": A, **GREEDY})).json()
    text = await _scrape(client)
    assert metric(text, "llamacpp:prompt_tokens_total") == 40
    assert metric(text, "llamacpp:tokens_predicted_total") == N
    # the prompt's chunks 0-16-32-40 (the last samples the first token), then one step per token
    assert metric(text, "llamacpp:n_decode_total") == 3 + N - 1
    assert metric(text, "mgserve_step_seconds_count", phase="prefill") == 3
    assert metric(text, "mgserve_step_seconds_count", phase="decode") == N - 1
    assert metric(text, "llamacpp:n_busy_slots_per_decode") == 1
    assert metric(text, "llamacpp:n_tokens_max") == 40 + N - 1
    assert metric(text, "mgserve_prompt_cache_hits_total") == 0
    assert metric(text, "mgserve_time_to_first_token_seconds_count") == 1
    assert metric(text, "mgserve_inter_token_latency_seconds_count") == N - 1
    assert metric(text, "mgserve_requests_total", finish_reason="length") == 1
    assert metric(text, "mgserve_checkpoint_device_bytes") == _nbytes(client)  # the one at 32
    assert metric(text, "llamacpp:prompt_seconds_total") > 0  # type: ignore[operator]
    assert metric(text, "llamacpp:prompt_tokens_seconds") > 0  # type: ignore[operator]
    slot = _slot_of(await (await client.get("/slots")).json(), first["id_slot"])
    assert (slot["state"], slot["n_past"]) == ("idle", 40 + N - 1)
    assert slot["checkpoints"] == [{"pos": 32, "memory": "device"}]

    # a second turn: the whole history (the last answer token was never fed) is reused
    tail = [11, 12, 13, 14, 15]
    turn2 = A + first["tokens"] + tail
    second = await (await client.post("/completion", json={"prompt": turn2, **GREEDY})).json()
    assert second["timings"]["cache_n"] == 40 + N - 1
    text = await _scrape(client)
    assert metric(text, "mgserve_prompt_cache_hits_total") == 1
    assert metric(text, "mgserve_prompt_tokens_reused_total") == 40 + N - 1
    assert metric(text, "llamacpp:prompt_tokens_total") == 40 + len(turn2) - (40 + N - 1)

    # an edited turn: from the checkpoint at 32 (one restore), the rest computed
    edited = A[:36] + [3, 4, 5, 6, 7]
    third = await (await client.post("/completion", json={"prompt": edited, **GREEDY})).json()
    assert third["timings"]["cache_n"] == 32
    text = await _scrape(client)
    assert metric(text, "mgserve_checkpoint_restores_total") == 1
    assert metric(text, "mgserve_prompt_tokens_reused_total") == 40 + N - 1 + 32
    assert metric(text, "llamacpp:prompt_tokens_total") == 40 + 6 + len(edited) - 32
    assert metric(text, "llamacpp:tokens_predicted_total") == 3 * N
    assert metric(text, "mgserve_requests_submitted_total") == 3
    assert metric(text, "mgserve_requests_total", finish_reason="length") == 3


async def test_a_stop_string_is_a_stop_not_a_cancellation(client: TestClient[Any, Any]) -> None:
    probe = await (await client.post("/completion", json={"prompt": A[:20], **GREEDY})).json()
    # a character of the same greedy answer's text ends it there
    stop = next(c for c in reversed(probe["content"]) if c.isascii() and c.isprintable())
    before = metric(await _scrape(client), "mgserve_requests_total", finish_reason="stop")
    body = {"prompt": A[:20], **GREEDY, "n_predict": N + 4, "stop": [stop]}
    r = await (await client.post("/completion", json=body)).json()
    assert r["stop_type"] == "word"
    text = await _scrape(client)
    assert metric(text, "mgserve_requests_total", finish_reason="stop") == before + 1  # type: ignore[operator]
    assert metric(text, "mgserve_requests_total", finish_reason="abort") == 0


def _nbytes(client: TestClient[Any, Any]) -> int:
    return client.server.app[SERVICE].engine._sched.checkpoints.nbytes  # type: ignore[no-any-return,index]


def _slot_of(slots: list[dict[str, Any]], i: int) -> dict[str, Any]:
    (slot,) = [s for s in slots if s["id"] == i]
    return slot
