"""What /v1/messages refuses: every field it does not implement and every malformed body gets a 4xx
in Anthropic's error shape, saying what is wrong and where."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestClient

USER = [{"role": "user", "content": "Hi"}]
BASE: dict[str, Any] = {"model": "x", "max_tokens": 16, "messages": USER}
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _with(**kw: Any) -> dict[str, Any]:
    return BASE | kw


def _turns(*content: Any) -> dict[str, Any]:
    """A body whose user turn holds ``content``."""
    return _with(messages=[{"role": "user", "content": list(content)}])


REFUSED: list[tuple[dict[str, Any], str]] = [
    # fields the route does not implement, named
    (_with(service_tier="auto"), "'service_tier' is not supported"),
    (_with(container="c1"), "'container' is not supported"),
    (_with(output_config={"effort": "low"}), "'output_config' is not supported"),
    (_with(cache_control={"type": "ephemeral"}), "'cache_control' is not supported"),
    (_with(seed=1), "'seed' is not supported"),
    # required and typed fields
    ({"model": "x", "messages": USER}, "'max_tokens' is required"),
    (_with(max_tokens=0), "'max_tokens' must be in [1, inf]"),
    (_with(max_tokens="8"), "'max_tokens' must be an integer"),
    (_with(temperature=1.5), "'temperature' must be in [0.0, 1.0]"),
    (_with(top_p=0), "'top_p' must be in (0, 1]"),
    (_with(top_k=-1), "'top_k' must be in [0, inf]"),
    (_with(stop_sequences=[1]), "'stop_sequences' must be a string or a list of strings"),
    (_with(stream="yes"), "'stream' must be a boolean"),
    (_with(metadata="u1"), "'metadata' must be an object"),
    # messages
    (_with(messages=[]), "'messages' must be a non-empty list"),
    (_with(messages="Hi"), "'messages' must be a non-empty list"),
    (_with(messages=[{"role": "robot", "content": "Hi"}]), "messages[0].role must be"),
    (_with(messages=[{"role": "user", "content": 3}]), "messages[0].content must be"),
    (_with(messages=[{"role": "user", "content": "Hi", "name": "u"}]), "messages[0].name is not"),
    (_turns({"type": "text"}), "messages[0].content[0].text must be a string"),
    (_turns({"type": "text", "text": "Hi", "citations": [{}]}), "content[0].citations is not"),
    (
        _turns({"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}),
        "messages[0].content[0]: image blocks are not supported",
    ),
    (_turns({"type": "document", "source": {}}), "document blocks are not supported"),
    (_turns({"type": "search_result"}), "block type 'search_result' is not supported"),
    (_turns({"type": "tool_use", "id": "t", "name": "f", "input": {}}), "in a user turn"),
    (_turns({"type": "tool_result", "content": "x"}), "content[0].tool_use_id must be a string"),
    (_turns({"type": "tool_result", "tool_use_id": "t", "is_error": 1}), "is_error must be a"),
    (
        _with(
            messages=[
                *USER,
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                *USER,
            ]
        ),
        "block type 'redacted_thinking' is not supported in an assistant turn",
    ),
    (
        _with(
            messages=[
                *USER,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
                *USER,
            ]
        ),
        "messages[1].content[0].input must be an object",
    ),
    (
        _with(messages=[*USER, {"role": "assistant", "content": [TOOL | {"type": "tool_use"}]}]),
        "a trailing assistant turn (a prefill) may hold text blocks only",
    ),
    (_with(system=5), "system must be a string or a list of text blocks"),
    (_with(system=[{"type": "image"}]), "system[0]: image blocks are not supported"),
    # tools
    (_with(tools={"name": "f"}), "'tools' must be a list"),
    (_with(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "server tools"),
    (_with(tools=[{"name": "f"}]), "tools[0].input_schema must be an object"),
    (_with(tools=[{"input_schema": {}}]), "tools[0].name must be a string"),
    (_with(tools=[TOOL | {"strict": True}]), "tools[0].strict is not supported"),
    (_with(tool_choice={"type": "any"}), "forces a tool call, but the request has no 'tools'"),
    (_with(tools=[TOOL], tool_choice={"type": "tool", "name": "g"}), "names 'g', which is not"),
    (_with(tools=[TOOL], tool_choice={"type": "tool"}), "tool_choice.name must be a string"),
    (_with(tools=[TOOL], tool_choice={"type": "any", "name": "f"}), "tool_choice.name is not"),
    (_with(tools=[TOOL], tool_choice={"type": "any"}), "writes no tool calls"),
    (_with(tool_choice="auto"), "tool_choice must be an object"),
    (_with(tool_choice={"type": "maybe"}), "tool_choice.type 'maybe' is not one of"),
    # thinking (the built-in Gemma's template has no thinking switch)
    (_with(thinking={"type": "enabled", "budget_tokens": 2048}), "no thinking switch"),
    (_with(thinking={"type": "between_tools"}), "thinking.type 'between_tools' is not"),
    (_with(thinking={"type": "disabled", "budget_tokens": 1}), "thinking.budget_tokens is not"),
]


@pytest.mark.parametrize(("body", "message"), REFUSED)
async def test_refused_with_anthropics_error_shape(
    client: TestClient[Any, Any], body: dict[str, Any], message: str
) -> None:
    for stream in (False, True):  # a refused stream is refused before the 200
        resp = await client.post("/v1/messages", json={"stream": stream} | body)
        assert resp.status == 400, await resp.text()
        err = await resp.json()
        assert set(err) == {"type", "error"} and err["type"] == "error"
        assert err["error"]["type"] == "invalid_request_error"
        assert message in err["error"]["message"], err


THINKING = [
    ({"type": "enabled", "budget_tokens": 512}, "at least 1024 and less than max_tokens"),
    ({"type": "enabled", "budget_tokens": 4096}, "at least 1024 and less than max_tokens"),
    ({"type": "enabled"}, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, "thinking.display"),
]


@pytest.mark.parametrize(("thinking", "message"), THINKING)
async def test_thinking_budget_checked_as_anthropic_checks_it(
    make_client: Callable[..., Any], thinking: dict[str, Any], message: str
) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=4096)
    resp = await client.post("/v1/messages", json=_with(max_tokens=2048, thinking=thinking))
    assert resp.status == 400 and message in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "malformed JSON body"),
        (b"[1, 2]", "the request body must be a JSON object"),
        (b"", "the request body must be a JSON object"),
    ],
)
async def test_malformed_bodies(client: TestClient[Any, Any], raw: bytes, message: str) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        err = await resp.json()
        assert err["type"] == "error" and message in err["error"]["message"]


async def test_count_tokens_takes_no_generation_fields(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/messages/count_tokens", json=BASE)
    assert resp.status == 400
    assert "'max_tokens' is not supported" in (await resp.json())["error"]["message"]


async def test_routing_errors_under_the_path_are_anthropics(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/messages")
    assert resp.status == 405 and (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await client.post("/v1/messages/batches", json=BASE)
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
    resp = await client.post("/v1/chat/completions", json={"messages": 1})  # OpenAI's shape there
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_too_large_body(make_client: Callable[..., Any]) -> None:
    client = await make_client(max_body_mb=1)
    body = _with(messages=[{"role": "user", "content": "x" * (2 << 20)}])
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 413
    assert (await resp.json())["error"]["type"] == "request_too_large"


async def test_the_client_raises_on_a_refusal(client: TestClient[Any, Any]) -> None:
    api = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0)
    try:
        with pytest.raises(anthropic.BadRequestError) as e:
            await api.messages.create(
                model="x",
                max_tokens=8,
                messages=USER,  # type: ignore[arg-type]
                extra_body={"top_k": -1},  # the current client has no sampling parameters
            )
    finally:
        await api.close()
    assert e.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'top_k' must be in [0, inf], got -1",
        },
    }
