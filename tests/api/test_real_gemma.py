"""The whole stack on the built-in Gemma 3 270M: real tokenizer, template, engine and model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytest.importorskip("mgserve.core.text.tokenizer", reason="the tokenizer module has not landed")
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def service(gemma_path: Path) -> Iterator[Service]:
    yield build_service(Settings(model=str(gemma_path), ctx_size=512, parallel=4))


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def test_service_reads_the_model(service: Service) -> None:
    assert service.architecture == "gemma3" and service.chat.name == "gemma"
    assert service.n_vocab == 262144 and service.engine.n_ctx == 512
    assert service.model_id == "gemma-3-270m-q4_k_m.gguf"
    assert service.chat.bos_token == "<bos>"


async def test_chat_prompt_tokenizes_turn_markers_as_special_tokens(
    client: TestClient[Any, Any], service: Service
) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = (await (await client.post("/apply-template", json={"messages": msgs})).json())[
        "prompt"
    ]
    assert prompt == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    body = {"content": prompt, "add_special": True}
    ids = (await (await client.post("/tokenize", json=body)).json())["tokens"]
    tok = service.tokenizer
    assert ids[0] == tok.bos_id and ids.count(tok.token_id("<start_of_turn>")) == 2
    assert tok.token_id("<end_of_turn>") in tok.eog_ids  # so a chat turn ends generation


async def test_chat_through_the_openai_client(client: TestClient[Any, Any]) -> None:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        r = await api.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
    finally:
        await api.close()
    text = r.choices[0].message.content
    assert text and text.strip()
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 8
    assert r.choices[0].finish_reason in ("stop", "length")


async def test_infill_is_refused_gemma_3_has_no_fim_tokens(
    client: TestClient[Any, Any], service: Service
) -> None:
    assert service.tokenizer.fim.missing() == ["prefix", "suffix", "middle"]
    body = {"input_prefix": "def f(", "input_suffix": "):\n"}
    resp = await client.post("/infill", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"].startswith(
        "infill is not supported by this model"
    )


async def _stream_text(client: TestClient[Any, Any], prompt: str) -> str:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "stream": True}
    resp = await client.post("/completion", json=body)
    assert resp.status == 200
    parts = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            parts.append(orjson.loads(line[6:])["content"])
    return "".join(parts)


async def test_concurrent_greedy_streams_match_solo_runs(client: TestClient[Any, Any]) -> None:
    prompts = [
        "The quick brown fox",
        "Once upon a time, in a land far away,",
        "def fibonacci(n):",
        "The three primary colors are",
    ]
    alone = [await _stream_text(client, p) for p in prompts]
    together = await asyncio.gather(*(_stream_text(client, p) for p in prompts))
    assert all(t.strip() for t in alone)
    assert list(together) == alone


async def test_ten_megabyte_word_is_refused_at_once_while_health_answers(
    client: TestClient[Any, Any], service: Service
) -> None:
    # tokenizing this took ~35 s on the event loop; 512 tokens of at most 48 bytes cannot hold it
    from tests.api.test_text_work import BIG, SHORT_CHAT, while_in_flight

    assert service.max_token_bytes == 48
    await (await client.post("/v1/chat/completions", json=SHORT_CHAT)).read()  # warm the model
    body = orjson.dumps({"prompt": "a" * BIG, "n_predict": 1})
    out = await while_in_flight(client, "/completion", body)
    assert out["status"] == 400 and out["error"]["code"] == "context_length_exceeded"
    assert out["big_s"] < 2.0 and max(out["health"]) < 0.5 and max(out["chat"]) < 2.0
