"""A reasoning budget served end to end on the CPU path: llama.cpp's converted qwen4exp file
(tests/data) with Qwen 3.5's template, whose prompt opens the reasoning block. A budget of k:
exactly k reasoning tokens, the close marker, then the answer (whole and streamed alike); a
grammar's answer follows the close; max_tokens still ends it all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = pytest.mark.asyncio(loop_scope="module")
FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen4exp.gguf"
CLOSE = "</think>\n\n"  # what the engine writes when the budget is spent (9 tokens here)
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    settings = Settings(
        model=str(FILE), ctx_size=256, parallel=2, device="cpu", chat_template="qwen3.5", threads=1
    )
    yield build_service(settings)


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def chat(client: TestClient[Any, Any], **body: Any) -> dict[str, Any]:
    base = {"messages": USER, "temperature": 0, "logprobs": True}
    resp = await client.post("/v1/chat/completions", json=base | body)
    assert resp.status == 200, await resp.text()
    return await resp.json()  # type: ignore[no-any-return]


def pieces(out: dict[str, Any]) -> list[bytes]:
    return [bytes(t["bytes"]) for t in out["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("k", [1, 3, 8])
async def test_a_budget_of_k(client: TestClient[Any, Any], service: Service, k: int) -> None:
    n_close = len(service.tokenizer.encode(CLOSE, add_special=False))
    body = {"thinking_budget_tokens": k, "max_tokens": k + n_close + 4, "ignore_eos": True}
    out = await chat(client, **body)
    got = pieces(out)
    assert b"".join(got[k : k + n_close]) == CLOSE.encode()
    assert CLOSE.encode() not in b"".join(got[:k])  # the model did not close it first
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"] == b"".join(got[:k]).decode(errors="replace").strip()
    assert msg["content"] == b"".join(got[k + n_close :]).decode(errors="replace")
    assert out["usage"]["completion_tokens"] == k + n_close + 4
    # streamed: the same reasoning and answer
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": USER, "temperature": 0, "stream": True} | body,
    )
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"]
        for line in (await resp.text()).splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]


async def test_max_tokens_ends_inside_the_close(client: TestClient[Any, Any]) -> None:
    out = await chat(client, thinking_budget_tokens=3, max_tokens=5, ignore_eos=True)
    assert b"".join(pieces(out)[3:]) == CLOSE.encode()[:2]
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5


async def test_a_json_answer_after_the_reasoning(client: TestClient[Any, Any]) -> None:
    fmt = {"type": "json_object"}
    out = await chat(client, thinking_budget_tokens=2, max_tokens=120, response_format=fmt)
    assert b"".join(pieces(out)[2:11]) == CLOSE.encode()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
