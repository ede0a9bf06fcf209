"""``n`` = 3 choices through the server on the built-in Gemma 3 270M: real engine and sampler, so
seeds, stop strings, streaming and usage are checked on tokens the model really draws."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings
from tests.api.test_choices import sse_events

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = "My favourite animal is"
SAMPLED = {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0, "seed": 1234}
CHAT = {"messages": [{"role": "user", "content": "Name an animal."}]}


@pytest.fixture(scope="module")
def service(gemma_path: Path) -> Iterator[Service]:
    yield build_service(Settings(model=str(gemma_path), ctx_size=256, parallel=4))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(module_client: TestClient[Any, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
    a = openai.AsyncOpenAI(base_url=str(module_client.make_url("/v1")), api_key="x", max_retries=0)
    yield a
    await a.close()


async def complete(client: TestClient[Any, Any], **kw: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True} | SAMPLED | kw
    r = await client.post("/v1/completions", json=body)
    out: dict[str, Any] = await r.json()
    assert r.status == 200, out
    return out


def texts(body: dict[str, Any]) -> list[str]:
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["text"] for c in body["choices"]]


async def test_seeded_choices_streamed_whole_and_n1(module_client: TestClient[Any, Any]) -> None:
    whole = await complete(module_client, n=3)
    assert len(set(texts(whole))) > 1  # sampled at temperature 1: the choices differ
    assert [c["finish_reason"] for c in whole["choices"]] == ["length"] * 3
    # the same seeded request again, streamed: the same choices, interleaved by index
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 3, "stream": True}
    events = await sse_events(await module_client.post("/v1/completions", json=body | SAMPLED))
    assert events.pop() == "[DONE]" and "[DONE]" not in events
    streamed, finish = ["", "", ""], [None, None, None]
    for e in events:
        (c,) = e["choices"]
        assert finish[c["index"]] is None  # nothing after a choice's finish_reason
        streamed[c["index"]] += c["text"]
        finish[c["index"]] = c["finish_reason"]
    assert streamed == texts(whole) and finish == ["length"] * 3
    one = await complete(module_client, n=1)
    assert texts(one) == texts(whole)[:1]  # choice 0 is the request with n=1
    u = whole["usage"]  # the prompt once, every choice's tokens
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 18 and u["total_tokens"] == u["prompt_tokens"] + 18

    stop = texts(whole)[1][2:4]  # reached by choice 1, maybe by the others
    stopped = await complete(module_client, n=3, stop=[stop])
    for free, c in zip(texts(whole), stopped["choices"], strict=True):
        at = free.find(stop)
        want = (free[:at], "stop") if at >= 0 else (free, "length")
        assert (c["text"], c["finish_reason"]) == want
    assert stopped["choices"][1]["finish_reason"] == "stop"


async def test_greedy_choices_are_identical(module_client: TestClient[Any, Any]) -> None:
    body = await complete(module_client, n=3, temperature=0, max_tokens=4)
    assert len(set(texts(body))) == 1 and texts(body)[0]


async def test_openai_client_chat_n3(api: openai.AsyncOpenAI) -> None:
    kw: dict[str, Any] = {"model": "gemma", "n": 3, "max_tokens": 6, "seed": 7}
    whole = await api.chat.completions.create(**CHAT, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    stream = await api.chat.completions.create(
        **CHAT, **kw, stream=True, stream_options={"include_usage": True}
    )
    parts, finish, usage = ["", "", ""], [None, None, None], None
    async for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or usage
    assert parts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert whole.usage is not None and usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
