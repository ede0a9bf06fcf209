"""The OpenAI routes through the official openai client, on the fake engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.http import SERVICE
from tests.api.fakes import BOS, SOT, FakeEngine, FakeTokenizer


def engine_of(client: TestClient[Any, Any]) -> FakeEngine:
    return client.server.app[SERVICE].engine  # type: ignore[return-value]


_opened: list[openai.AsyncOpenAI] = []


def oai(client: TestClient[Any, Any], key: str = "none") -> openai.AsyncOpenAI:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
    _opened.append(api)
    return api


@pytest.fixture(autouse=True)
async def _close_openai_clients() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().close()


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


async def test_chat_completion(client: TestClient[Any, Any]) -> None:
    r = await oai(client).chat.completions.create(model="x", messages=MSGS)  # type: ignore[arg-type]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == "fake-model"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "Hello, world!"
    assert r.choices[0].finish_reason == "stop"
    req = engine_of(client).submitted[-1]
    prompt = "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert req.prompt == FakeTokenizer().encode(prompt, add_special=True, parse_special=True)
    assert req.prompt[:2] == [BOS, SOT]
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(req.prompt)
    assert r.usage.completion_tokens == len("Hello, world!") + 1  # the eos token counts
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra is not None and r.model_extra["timings"]["predicted_n"] == 14


async def test_chat_stream_with_usage(client: TestClient[Any, Any]) -> None:
    stream = await oai(client).chat.completions.create(
        model="x",
        messages=MSGS,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world!"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 14
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_stop_string_and_max_tokens(client: TestClient[Any, Any]) -> None:
    r = await oai(client).chat.completions.create(model="x", messages=MSGS, stop=["o, w", "zzz"])  # type: ignore[arg-type]
    assert r.choices[0].message.content == "Hell" and r.choices[0].finish_reason == "stop"
    r = await oai(client).chat.completions.create(model="x", messages=MSGS, max_tokens=5)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5


async def test_stop_string_split_across_stream_chunks_is_never_sent(
    client: TestClient[Any, Any],
) -> None:
    stream = await oai(client).chat.completions.create(
        model="x", messages=MSGS, stop="world", stream=True
    )  # type: ignore[arg-type]
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == "Hello, "
    assert not any("w" in p for p in parts)


async def test_chat_logprobs(client: TestClient[Any, Any]) -> None:
    r = await oai(client).chat.completions.create(
        model="x", messages=MSGS, logprobs=True, top_logprobs=3, max_tokens=4
    )  # type: ignore[arg-type]
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [t.token for t in lp.content] == ["H", "e", "l", "l"]
    assert lp.content[0].bytes == [ord("H")] and lp.content[0].logprob == -0.25
    assert [t.token for t in lp.content[0].top_logprobs] == ["H", "I", "J"]
    assert [t.logprob for t in lp.content[0].top_logprobs] == [-0.25, -1.25, -2.25]
    assert engine_of(client).submitted[-1].sampling.n_probs == 3


async def test_completions_text_and_token_prompts(client: TestClient[Any, Any]) -> None:
    api = oai(client)
    r = await api.completions.create(model="x", prompt="Say hi", max_tokens=3, logprobs=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "Hel" and r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == ["H", "e", "l"] and lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs is not None and lp.top_logprobs[0] == {"H": -0.25, "I": -1.25}
    engine = engine_of(client)
    assert engine.submitted[-1].prompt == [BOS, *b"Say hi"]
    r = await api.completions.create(model="x", prompt=[1, 2, 3], max_tokens=2)
    assert engine.submitted[-1].prompt == [1, 2, 3]  # token prompts get no BOS
    assert r.usage is not None and r.usage.prompt_tokens == 3


async def test_completions_stream(client: TestClient[Any, Any]) -> None:
    stream = await oai(client).completions.create(
        model="x", prompt="x", stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, world!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 2


async def test_completions_echo(client: TestClient[Any, Any]) -> None:
    """echo: the prompt's text starts the answer, whole and streamed; token prompts echo the
    tokens' text (the fake tokenizer is byte-level: ids 72, 105 are "Hi")."""
    api = oai(client)
    r = await api.completions.create(model="x", prompt="Say hi", max_tokens=3, echo=True)
    assert r.choices[0].text == "Say hiHel"
    assert engine_of(client).submitted[-1].prompt == [BOS, *b"Say hi"]  # the answer's prompt
    assert r.usage is not None and r.usage.completion_tokens == 3
    r = await api.completions.create(model="x", prompt=[72, 105], max_tokens=2, echo=True)
    assert r.choices[0].text == "HiHe"
    stream = await api.completions.create(model="x", prompt="Yo ", echo=True, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == "Yo "  # the echo comes first, in a chunk of its own
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Yo Hello, world!"
    r = await api.completions.create(model="x", prompt="a", max_tokens=2, echo=False)
    assert r.choices[0].text == "He"


async def test_models(client: TestClient[Any, Any]) -> None:
    models = await oai(client).models.list()
    assert [m.id for m in models.data] == ["fake-model"]


async def test_sampling_fields_reach_the_engine(client: TestClient[Any, Any]) -> None:
    await oai(client).chat.completions.create(
        model="x",
        messages=MSGS,
        temperature=0.0,
        top_p=0.5,
        seed=7,
        presence_penalty=0.5,  # type: ignore[arg-type]
        frequency_penalty=-0.5,
        logit_bias={"65": 2.5, "66": -100},
        max_completion_tokens=3,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repeat_penalty": 1.1,
            "repeat_last_n": 32,
            "ignore_eos": True,
        },
    )
    req = engine_of(client).submitted[-1]
    sp = req.sampling
    assert (sp.temperature, sp.top_p, sp.seed, sp.top_k, sp.min_p) == (0.0, 0.5, 7, 5, 0.1)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.5)
    assert (sp.repeat_penalty, sp.repeat_last_n) == (1.1, 32)
    assert sp.logit_bias == ((65, 2.5), (66, -100.0))
    assert req.max_tokens == 3 and req.ignore_eos


@pytest.mark.parametrize("key", ["secret"])
async def test_api_key(make_client: Any, key: str) -> None:
    client = await make_client(api_key=key)
    with pytest.raises(openai.AuthenticationError):
        await oai(client, "wrong").chat.completions.create(model="x", messages=MSGS)  # type: ignore[arg-type]
    r = await oai(client, key).chat.completions.create(model="x", messages=MSGS)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "Hello, world!"
    resp = await client.get("/props")
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    assert (await client.get("/health")).status == 200
    assert (await client.get("/props", headers={"X-Api-Key": key})).status == 200
