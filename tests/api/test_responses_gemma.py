"""/v1/responses through the openai client on the built-in Gemma 3 270M: the real tokenizer,
template, engine and model, greedy, so a streamed response must equal the whole one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTION = "What is the capital of France?"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def service(gemma_path: Path) -> Iterator[Service]:
    yield build_service(Settings(model=str(gemma_path), ctx_size=512, parallel=2))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(module_client: TestClient[Any, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
    a = openai.AsyncOpenAI(base_url=str(module_client.make_url("/v1")), api_key="x", max_retries=0)
    yield a
    await a.close()


async def test_streamed_response_equals_the_whole_one(api: openai.AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"model": "gemma", "max_output_tokens": 24, "temperature": 0}
    whole = await api.responses.create(input=QUESTION, **kw)
    async with api.responses.stream(input=QUESTION, **kw) as stream:
        events = [e async for e in stream]
    # the last event carries the response: response.completed, or response.incomplete when the
    # answer reached max_output_tokens (which the client's get_final_response does not take)
    last = events[-1]
    assert last.type == "response." + whole.status  # type: ignore[operator]
    streamed = last.response  # type: ignore[union-attr]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert whole.output_text.strip() and "".join(deltas) == whole.output_text
    assert streamed.output_text == whole.output_text and streamed.status == whole.status
    assert [o.type for o in whole.output] == ["message"]  # Gemma does not reason
    assert streamed.usage is not None and whole.usage is not None
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert whole.usage.output_tokens_details.reasoning_tokens == 0


async def test_instructions_and_max_output_tokens(api: openai.AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"model": "gemma", "temperature": 0, "max_output_tokens": 16}
    plain = await api.responses.create(input=QUESTION, **kw)
    pirate = await api.responses.create(
        input=QUESTION, instructions="Answer only with the word 'Arrr', nothing else.", **kw
    )
    assert pirate.output_text != plain.output_text
    assert pirate.usage is not None and plain.usage is not None
    assert pirate.usage.input_tokens > plain.usage.input_tokens
    r = await api.responses.create(input=QUESTION, model="gemma", max_output_tokens=2)
    assert r.status == "incomplete" and r.usage is not None and r.usage.output_tokens == 2
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"


async def test_text_format_json_schema(api: openai.AsyncOpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    r = await api.responses.create(
        model="gemma",
        input=QUESTION + " Answer in JSON.",
        text={"format": fmt},
        max_output_tokens=24,
        temperature=0,
    )
    assert r.status == "completed"
    assert json.loads(r.output_text)["city"] in ("Paris", "Lyon", "Nice")
