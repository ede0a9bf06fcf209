"""/v1/messages through the anthropic client on the built-in Gemma 3 270M: the real tokenizer,
template, engine and model, greedy, so a streamed answer must equal the whole one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # sent as the HTTP field: the current client has no such parameter


@pytest.fixture(scope="module")
def service(gemma_path: Path) -> Iterator[Service]:
    yield build_service(Settings(model=str(gemma_path), ctx_size=512, parallel=2))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(module_client: TestClient[Any, Any]) -> AsyncIterator[anthropic.AsyncAnthropic]:
    a = anthropic.AsyncAnthropic(
        base_url=str(module_client.make_url("")), api_key="x", max_retries=0
    )
    yield a
    await a.close()


async def test_streamed_message_equals_the_whole_one(api: anthropic.AsyncAnthropic) -> None:
    kw: dict[str, Any] = {"model": "gemma", "max_tokens": 24, "extra_body": GREEDY}
    whole = await api.messages.create(messages=QUESTION, **kw)  # type: ignore[arg-type]
    async with api.messages.stream(messages=QUESTION, **kw) as stream:  # type: ignore[arg-type]
        text = "".join([t async for t in stream.text_stream])
        streamed = await stream.get_final_message()
    assert whole.content[0].type == "text" and whole.content[0].text.strip()
    assert text == whole.content[0].text
    # the same message but for its id and how much of the prompt the cache held
    same = {"exclude": {"id", "usage"}, "exclude_none": True}
    assert streamed.model_dump(**same) == whole.model_dump(**same)
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    n_prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert n_prompt == streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0)
    counted = await api.messages.count_tokens(model="gemma", messages=QUESTION)  # type: ignore[arg-type]
    assert counted.input_tokens == n_prompt


async def test_system_prompt_changes_the_answer(api: anthropic.AsyncAnthropic) -> None:
    kw: dict[str, Any] = {"model": "gemma", "max_tokens": 16, "extra_body": GREEDY}
    plain = await api.messages.create(messages=QUESTION, **kw)  # type: ignore[arg-type]
    pirate = await api.messages.create(
        messages=QUESTION,  # type: ignore[arg-type]
        system="Answer only with the word 'Arrr', nothing else.",
        **kw,
    )
    assert pirate.content != plain.content
    assert pirate.usage.input_tokens + (pirate.usage.cache_read_input_tokens or 0) > (
        plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    )


async def test_stop_sequence_and_max_tokens(api: anthropic.AsyncAnthropic) -> None:
    kw: dict[str, Any] = {"model": "gemma", "extra_body": GREEDY}
    whole = await api.messages.create(messages=QUESTION, max_tokens=24, **kw)  # type: ignore[arg-type]
    assert whole.content[0].type == "text"
    text = whole.content[0].text
    word = text.split()[2]  # a stop string the greedy answer reaches after some text
    r = await api.messages.create(
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=24,
        stop_sequences=[word],
        **kw,
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].type == "text" and r.content[0].text == text[: text.index(word)]
    r = await api.messages.create(messages=QUESTION, max_tokens=2, **kw)  # type: ignore[arg-type]
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2
