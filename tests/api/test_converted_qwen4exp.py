"""A qwen4exp file written by llama.cpp's own converter (tests/data/converted_qwen4exp.gguf:
1-D hyper-connection norms, ``qwen35`` pre-tokenizer, Qwen3.5's chat template) served end to end
on the CPU path: template, tokenizer, engine, model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings
from tests.prom import metric

pytestmark = pytest.mark.asyncio(loop_scope="module")
FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen4exp.gguf"


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    settings = Settings(model=str(FILE), ctx_size=256, parallel=2, device="cpu", batch_size=32)
    yield build_service(dataclasses.replace(settings, checkpoint_every=64))


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def test_loads_with_the_published_layout(service: Service) -> None:
    assert service.architecture == "qwen4exp"
    assert service.tokenizer.token_id("<|im_start|>") is not None


async def test_chat_renders_the_template_and_answers(client: TestClient[Any, Any]) -> None:
    msgs = [{"role": "user", "content": "Hello there"}]
    r = await client.post("/apply-template", json={"messages": msgs})
    prompt = (await r.json())["prompt"]
    assert prompt.startswith("<|im_start|>user\nHello there<|im_end|>\n")
    assert prompt.rstrip().endswith("<|im_start|>assistant") or "<think>" in prompt
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    assert out["usage"]["completion_tokens"] >= 1
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


async def test_greedy_is_the_same_twice(client: TestClient[Any, Any]) -> None:
    body = {"prompt": [5, 17, 42, 99, 7], "n_predict": 6, "temperature": 0}
    a = await (await client.post("/completion", json=body)).json()
    b = await (await client.post("/completion", json=body)).json()
    assert a["tokens_predicted"] >= 1 and a["content"] == b["content"]


async def test_an_edited_prompt_reuses_the_nearest_checkpoint(client: TestClient[Any, Any]) -> None:
    """A 100-token prompt leaves checkpoints at 64 and 96 (chunks of 32); one sharing its first
    80 tokens computes from 64, which timings.cache_n and the metrics show."""
    a = [(7 * i) % 200 + 20 for i in range(100)]
    b = a[:80] + [3, 4, 5, 6, 8, 9, 10, 11, 12, 13]
    body = {"n_predict": 4, "temperature": 0}
    await client.post("/completion", json={**body, "prompt": a})
    warm = await (await client.post("/completion", json={**body, "prompt": b})).json()
    assert (warm["timings"]["cache_n"], warm["timings"]["prompt_n"]) == (64, 26)
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "mgserve_checkpoint_restores_total") == 1
    assert metric(metrics, "mgserve_prompt_tokens_reused_total") == 64
