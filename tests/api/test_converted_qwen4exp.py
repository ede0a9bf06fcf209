"""A qwen4exp file written by llama.cpp's own converter (tests/data/converted_qwen4exp.gguf:
1-D hyper-connection norms, ``qwen35`` pre-tokenizer, Qwen3.5's chat template) served end to end
on the CPU path: template, tokenizer, engine, model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = pytest.mark.asyncio(loop_scope="module")
FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen4exp.gguf"


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    yield build_service(Settings(model=str(FILE), ctx_size=256, parallel=2, device="cpu"))


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
