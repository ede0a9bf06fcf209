"""Hostile input, case by case: oversized bodies and prompts, JSON nested 10^5 deep, invalid
UTF-8, huge n / max_tokens / logit_bias / stop lists, and the sampling values whose arithmetic would
overflow in the engine's step (a step shared by every batched request). Each is a 4xx naming the
field, and the server keeps serving. test_fuzz.py covers the same ground at random."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.api.test_admission import real_engine
from tests.api.test_validation import assert_still_serving

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}


def _nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def _schema(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


async def _refused(r: Any, status: int, param: str | None, *words: str) -> str:
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    return err["message"]  # type: ignore[no-any-return]


@pytest.fixture
async def real(make_client: Any) -> TestClient[Any, Any]:
    """The API over the real engine (its sampler runs) on the fake model."""
    return await make_client(engine=real_engine(), max_body_mb=64, chat_template="chatml")  # type: ignore[no-any-return]


async def test_deeply_nested_bodies_are_a_400(real: TestClient[Any, Any]) -> None:
    for raw in (_nested(10**5), '{"a":' * 10**5 + "1" + "}" * 10**5):
        r = await real.post(CHAT, data=raw, headers=JSON)
        await _refused(r, 400, None, "nested deeper than 128 levels", "byte offset")
    # deep, but within what the JSON reader takes: refused before a template, the grammar
    # compiler or a message walk recurses into a RecursionError
    msgs = json.dumps(MSG)
    cases = [
        ("/completion", '{"prompt":"a","json_schema":' + _schema(300) + "}", "json_schema"),
        (CHAT, '{"messages":[{"role":"user","content":' + _nested(900) + "}]}", "messages"),
        (CHAT, '{"messages":' + msgs + ',"chat_template_kwargs":{"x":' + _nested(500) + "}}",
         "chat_template_kwargs"),
    ]  # fmt: skip
    for path, raw, param in cases:
        r = await real.post(path, data=raw, headers=JSON)
        await _refused(r, 400, param, "deeper than 128")
    await assert_ok(real)


async def test_tool_arguments_nested_too_deep_stay_text(real: TestClient[Any, Any]) -> None:
    args = _nested(5000)  # a string field: JSON inside it is parsed for the template, or kept
    calls = [{"type": "function", "id": "1", "function": {"name": "f", "arguments": args}}]
    msgs = MSG + [{"role": "assistant", "tool_calls": calls}]
    r = await real.post("/apply-template", json={"messages": msgs})
    assert r.status == 200, await r.text()  # was a 500: json.loads' RecursionError


async def test_invalid_utf8_names_the_byte(real: TestClient[Any, Any]) -> None:
    raw = b'{"messages":[{"role":"user","content":"ab\xff"}]}'
    msg = await _refused(await real.post(CHAT, data=raw, headers=JSON), 400, None)
    assert "invalid UTF-8 at byte offset 41 (0xff" in msg and "surrogate" not in msg
    raw = b'{"prompt":"\xc3("}'
    msg = await _refused(await real.post("/completion", data=raw, headers=JSON), 400, None)
    assert "byte offset 11 (0xc3" in msg
    await assert_ok(real)


async def test_oversized_body_and_prompt(make_client: Any) -> None:
    client = await make_client(max_body_mb=1)
    r = await client.post(CHAT, data=b'{"x":"' + b"a" * (1 << 20) + b'"}', headers=JSON)
    assert r.status == 413 and "too large" in (await r.json())["error"]["message"]
    r = await client.post("/completion", json={"prompt": "x" * 100_000})
    await _refused(r, 400, "prompt", "context")
    r = await client.post("/completion", json={"prompt": [1] * 100_000})
    await _refused(r, 400, "prompt", "100000 tokens")
    await assert_still_serving(client)


HUGE: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"messages": MSG, "n": 10**9}, "n"),
    (CHAT, {"messages": MSG, "max_tokens": 10**18}, "max_tokens"),
    ("/completion", {"prompt": "a", "n_predict": 10**30}, "n_predict"),
    (CHAT, {"messages": MSG, "logit_bias": {str(i): 1 for i in range(10**6)}}, "logit_bias"),
    ("/completion", {"prompt": "a", "logit_bias": [[5, 1]] * 10**6}, "logit_bias"),
    (CHAT, {"messages": MSG, "stop": ["x"] * 10**5}, "stop"),
    ("/completion", {"prompt": "a", "stop": ["x"] * 10**5}, "stop"),
    # what the engine's step would fail on (and fail every request batched with it)
    (CHAT, {"messages": MSG, "seed": 2**64}, "seed"),
    ("/completion", {"prompt": "a", "seed": 10**30}, "seed"),
    ("/completion", {"prompt": "a", "top_k": 10**30}, "top_k"),
    ("/completion", {"prompt": "a", "temperature": 5e-324}, "temperature"),
    ("/completion", {"prompt": "a", "repeat_penalty": 0}, "repeat_penalty"),
    ("/completion", {"prompt": "a", "repeat_penalty": 1e-300}, "repeat_penalty"),
    ("/completion", {"prompt": "a", "logit_bias": [[5, 1e39]]}, "logit_bias"),
    ("/completion", {"prompt": "a", "logit_bias": [[t, False] for t in range(260)]}, "logit_bias"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), HUGE, ids=[f"{h[2]}-{i}" for i, h in enumerate(HUGE)]
)
async def test_huge_values_are_a_400_naming_the_field(
    real: TestClient[Any, Any], path: str, body: dict[str, Any], param: str
) -> None:
    await _refused(await real.post(path, json=body), 400, param)
    await assert_ok(real)


async def test_values_at_the_bounds_are_served(real: TestClient[Any, Any]) -> None:
    """What the bounds still let through runs without an engine error."""
    for extra in (
        {"seed": 2**64 - 1},
        {"repeat_last_n": 2**63},  # a window beyond the context: the whole context
        {"temperature": 1e-6},
        {"repeat_penalty": 1e-6},
        {"repeat_penalty": 1e6},
        {"logit_bias": [[5, 1e9], [6, -1e9]]},
        {"logit_bias": [[t, False] for t in range(259)]},  # all but one banned
        {"top_k": 2**63},
    ):
        body = {"prompt": "a", "n_predict": 3, "ignore_eos": True, "n_probs": 2} | extra
        r = await real.post("/completion", json=body)
        assert r.status == 200, (extra, await r.text())
        assert (await r.json())["tokens_predicted"] == 3


async def assert_ok(client: TestClient[Any, Any]) -> None:
    r = await client.post("/completion", json={"prompt": "a", "n_predict": 2, "ignore_eos": True})
    assert r.status == 200, await r.text()
