"""The README's chat examples on the built-in default model (SmolLM2-135M-Instruct): a fresh
install answers them sensibly, through the real tokenizer, template, engine and model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    yield build_service(Settings(ctx_size=512, parallel=2, threads=1))  # no model: the default


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def _chat(client: TestClient[Any, Any], content: str, max_tokens: int) -> str:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    return str((await resp.json())["choices"][0]["message"]["content"])


async def test_the_default_is_the_chat_model(service: Service) -> None:
    assert service.model_id == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert service.chat.name == "gguf"  # the file's own ChatML template


async def test_readme_curl_example_names_colours(client: TestClient[Any, Any]) -> None:
    text = (await _chat(client, "Name three colours.", 32)).lower()
    colours = ("red", "orange", "yellow", "green", "blue", "purple", "violet", "black", "white")
    assert sum(c in text for c in colours) >= 2, text


async def test_answers_a_plain_question(client: TestClient[Any, Any]) -> None:
    assert "paris" in (await _chat(client, "What is the capital of France?", 16)).lower()


async def test_readme_openai_stream_example(client: TestClient[Any, Any]) -> None:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await api.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1.gguf",
            messages=[{"role": "user", "content": "Write a haiku about GPUs."}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            seed=1,
        )
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
    finally:
        await api.close()
    words = "".join(parts).split()
    assert len(words) >= 5 and usage is not None and usage.completion_tokens == 24
