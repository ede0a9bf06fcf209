"""Every bad request gets a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "x", "messages": MSG} | kw


BAD: list[tuple[str, Any, str | None]] = [
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    (CHAT, chat(messages=[]), "messages"),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
        "messages",
    ),  # the Gemma template's own raise_exception
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens=-3), "max_tokens"),
    (CHAT, chat(max_tokens=10**9), "max_tokens"),
    (CHAT, chat(max_tokens="5"), "max_tokens"),
    (CHAT, chat(temperature=-0.1), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(n=3), "n"),  # more choices than the fake engine's 2 slots
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n="2"), "n"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n"),
    ("/completion", {"prompt": "hi", "n": 2}, "n"),  # llama-server's: one completion
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(stop=[1, 2]), "stop"),
    (CHAT, chat(stop=["a"] * 17), "stop"),
    (CHAT, chat(logit_bias={"99999": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"5": "big"}), "logit_bias"),
    (CHAT, chat(top_logprobs=3), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    (CHAT, chat(seed=1.5), "seed"),
    (CHAT, chat(stream_options=3), "stream_options"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format"),
    (CHAT, chat(response_format="json"), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
        "response_format",
    ),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": [], "strict": 1}}),
        "response_format",
    ),
    (
        "/v1/completions",
        {"prompt": "a", "response_format": {"type": "json_object", "schema": 3}},
        "response_format",
    ),
    ("/completion", {"prompt": "a", "json_schema": {"type": "strin"}}, "json_schema"),
    ("/completion", {"prompt": "a", "json_schema": "{}"}, "json_schema"),
    ("/completion", {"prompt": "a", "grammar": "root ::= foo"}, "grammar"),
    ("/completion", {"prompt": "a", "grammar": 5}, "grammar"),
    ("/completion", {"prompt": "a", "grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 300}]), "messages"),  # > n_ctx
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "a"}}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 300}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ("/completion", {"prompt": "a", "n_predict": 0}, "n_predict"),
    ("/completion", {"prompt": "a", "n_probs": -1}, "n_probs"),
    ("/completion", {"prompt": [1, None]}, "prompt"),
    ("/completion", {"prompt": "a", "logit_bias": [[1]]}, "logit_bias"),
    ("/completion", {"prompt": "a", "repeat_last_n": -2}, "repeat_last_n"),
    ("/completion", {"prompt": "a", "min_p": 2}, "min_p"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [999999]}, "tokens"),
    ("/apply-template", {"messages": [{"role": "bot", "content": "x"}]}, "messages"),
]


async def assert_still_serving(client: TestClient[Any, Any]) -> None:
    resp = await client.post(CHAT, json=chat(max_tokens=3))
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "Hel"


@pytest.mark.parametrize(("path", "body", "param"), BAD)
async def test_bad_request_is_400(
    client: TestClient[Any, Any], path: str, body: Any, param: str | None
) -> None:
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    await assert_still_serving(client)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
async def test_malformed_body(client: TestClient[Any, Any], raw: bytes) -> None:
    resp = await client.post(CHAT, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "invalid_request_error"
    await assert_still_serving(client)


async def test_template_error_message_reaches_the_client(client: TestClient[Any, Any]) -> None:
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    resp = await client.post(CHAT, json=chat(messages=two_users))
    assert "alternate" in (await resp.json())["error"]["message"]


async def test_too_long_prompt_says_so(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "x" * 300})
    err = (await resp.json())["error"]
    assert err["code"] == "context_length_exceeded" and "256" in err["message"]


async def test_unknown_route_wrong_method_and_huge_body(make_client: Any) -> None:
    client = await make_client(max_body_mb=1)
    resp = await client.get("/v1/nope")
    assert resp.status == 404
    assert (await resp.json())["error"]["message"] == "no route GET /v1/nope"
    resp = await client.get(CHAT)
    assert resp.status == 405 and "error" in await resp.json()
    assert resp.headers["Allow"] == "POST"
    resp = await client.post(CHAT, data=b"x" * (2 * 1024 * 1024))
    assert resp.status == 413 and "too large" in (await resp.json())["error"]["message"]
    await assert_still_serving(client)
