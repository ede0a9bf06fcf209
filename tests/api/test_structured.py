"""Structured output on the built-in Gemma 3 270M: sampled answers under a JSON schema, JSON
mode, a GBNF grammar, and bad schemas refused. A 270M base model does not write JSON on its own,
so every valid answer here is the grammar's doing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CHAT = "/v1/chat/completions"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
        "word": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "confidence", "word"],
    "additionalProperties": False,
}
# the hundred sampled answers: few tokens each (a CPU step of 16 rows of Gemma is slow)
SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# the hundred where a GPU serves them; on the CPU, whose reference forward runs row by
# row (~50 ms a row on the 2-core CI machine), fewer (test_structured_sampled.py: a hundred on
# the tiny llama)
N_SAMPLED = 100 if torch.cuda.is_available() else 24


@pytest.fixture(scope="module")
def service(gemma_path: Path) -> Iterator[Service]:
    yield build_service(Settings(model=str(gemma_path), ctx_size=256, parallel=16))


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 40} | kw


def json_schema(schema: Any, strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": strict}}


async def test_sampled_answers_under_a_schema_all_parse_and_validate(
    client: TestClient[Any, Any],
) -> None:
    body = chat("Is the sky blue? Answer in JSON.", temperature=1.0, top_p=1.0, min_p=0)
    body["response_format"] = json_schema(SMALL)

    async def one(seed: int) -> tuple[str, str]:
        r = await (await client.post(CHAT, json=body | {"seed": seed})).json()
        return r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]

    outs = await asyncio.gather(*(one(seed) for seed in range(N_SAMPLED)))
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SMALL)
    assert len({text for text, _ in outs}) > 5  # sampled: not one answer a hundred times


async def test_json_object_mode_on_both_openai_routes(client: TestClient[Any, Any]) -> None:
    fmt = {"type": "json_object"}
    r = await client.post(CHAT, json=chat("Give me a JSON object.", temperature=0) | {
        "response_format": fmt, "max_tokens": 64})  # fmt: skip
    c = (await r.json())["choices"][0]
    if c["finish_reason"] == "stop":  # else cut at max_tokens: the text is a prefix of an object
        assert isinstance(json.loads(c["message"]["content"]), dict)
    assert c["message"]["content"].startswith("{")
    body = {"prompt": "JSON:", "max_tokens": 24, "seed": 3, "response_format": json_schema(SCHEMA)}
    r = await client.post("/v1/completions", json=body)
    c = (await r.json())["choices"][0]
    assert c["finish_reason"] == "stop"
    jsonschema.validate(json.loads(c["text"]), SCHEMA)


async def test_llama_completion_takes_gbnf_and_json_schema(client: TestClient[Any, Any]) -> None:
    for seed in range(5):
        body = {"prompt": "Is water wet?", "grammar": 'root ::= "yes" | "no"', "seed": seed}
        r = await (await client.post("/completion", json=body | {"n_predict": 8})).json()
        assert r["content"] in ("yes", "no") and r["stop_type"] == "eos", r
    body = {"prompt": "Data:", "json_schema": SCHEMA, "n_predict": 24, "temperature": 0}
    r = await (await client.post("/completion", json=body)).json()
    jsonschema.validate(json.loads(r["content"]), SCHEMA)


async def test_streamed_answer_under_a_schema(client: TestClient[Any, Any]) -> None:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await api.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=40,
            seed=1,
            response_format=json_schema(SCHEMA, strict=False),  # type: ignore[arg-type]
            stream=True,
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    finally:
        await api.close()
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


BAD = [
    (CHAT, chat("x", response_format=json_schema({"type": "strin"})), "response_format"),
    (CHAT, chat("x", response_format=json_schema({"$ref": "#/defs/no"})), "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ("/completion", {"prompt": "x", "json_schema": {"required": 3}}, "json_schema"),
    ("/completion", {"prompt": "x", "grammar": "root ::= nowhere"}, "grammar"),
    ("/completion", {"prompt": "x", "grammar": 'root ::= ("a"'}, "grammar"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
async def test_bad_schemas_and_grammars_are_400s_naming_the_field(
    client: TestClient[Any, Any], path: str, body: dict[str, Any], param: str
) -> None:
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == param and param in err["message"], err
