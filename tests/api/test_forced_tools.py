"""Forced tool calls through the server: ``tool_choice`` required / a named function on
/v1/chat/completions, Anthropic's ``any`` / ``tool`` on /v1/messages.

With the fake engine (a fixed reply): the request reaches the engine with the grammar of the
forced calls, which allows the reply the fake writes, and the refusals. With the built-in Gemma 3
270M under Qwen 3.5's (XML calls) and Qwen 3's (JSON calls) templates, through the official
clients: a base model this small writes no tool calls of its own, so every call that comes back,
whole or streamed, with arguments that validate against the tool's schema, is the grammar's doing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from mgserve.api.app import create_app
from mgserve.api.service import Service, build_service
from mgserve.config import Settings
from tests.api.fakes import EOS
from tests.api.test_openai import _close_openai_clients, engine_of, oai  # noqa: F401

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
SEARCH: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 16}},
    "required": ["query"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS: Any = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
ANTHROPIC_TOOLS: Any = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
MSGS: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
REPLY = "The weather, then.\n</think>\n\n" + CALL  # Qwen 3.5's prompt opened the think block
NAMED = {"type": "function", "function": {"name": "search"}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def allows(grammar: Any, text: str) -> bool:
    """Whether a grammar of the fake (byte-level) vocabulary allows ``text``, then its end."""
    m = grammar.matcher()
    for b in text.encode():
        if b not in m.allowed().tolist():
            return False
        m.advance(b)
    return EOS in m.allowed().tolist()


async def test_forced_calls_reach_the_engine_as_a_grammar(make_client: Any) -> None:
    client = await make_client(chat_template="qwen3.5", n_ctx=4096, reply=REPLY.encode())
    api = oai(client)
    kw: Any = {"model": "x", "messages": MSGS, "tools": TOOLS}
    r = await api.chat.completions.create(tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]
    grammar = engine_of(client).submitted[-1].grammar
    assert grammar is not None and grammar.spec.kind == "lark"
    # the prompt ended inside Qwen 3.5's think block: the engine holds the grammar back until the
    # block closes (the model's or the budget's </think>), so the grammar is the calls alone
    assert engine_of(client).submitted[-1].reasoning is not None
    assert allows(grammar, CALL)
    assert not allows(grammar, REPLY) and not allows(grammar, "It is sunny.")
    await api.chat.completions.create(
        tool_choice=NAMED, parallel_tool_calls=False, **kw, extra_body=NO_THINKING
    )
    grammar = engine_of(client).submitted[-1].grammar
    assert grammar is not None and "get_weather" not in grammar.spec.text
    one = "<tool_call>\n<function=search>\n<parameter=query>\nParis\n</parameter>\n</function>\n"
    assert allows(grammar, one + "</tool_call>")
    assert not allows(grammar, one + "</tool_call>\n" + one + "</tool_call>")
    await api.chat.completions.create(tool_choice="auto", **kw)
    assert engine_of(client).submitted[-1].grammar is None


async def test_responses_required_and_named_force_calls(make_client: Any) -> None:
    """/v1/responses takes the chat route's forced calls: the grammar reaches the engine and the
    call comes back as a function_call item."""
    client = await make_client(chat_template="qwen3.5", n_ctx=4096, reply=REPLY.encode())
    api = oai(client)
    tools: Any = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    r = await api.responses.create(model="x", input="Weather?", tools=tools, tool_choice="required")
    grammar = engine_of(client).submitted[-1].grammar
    assert grammar is not None and grammar.spec.kind == "lark" and allows(grammar, CALL)
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    await api.responses.create(
        model="x", input="Weather?", tools=tools, tool_choice={"type": "function", "name": "search"}
    )
    grammar = engine_of(client).submitted[-1].grammar
    assert grammar is not None and "get_weather" not in grammar.spec.text


async def test_anthropic_any_and_tool_force_calls(make_client: Any) -> None:
    client = await make_client(chat_template="qwen3.5", n_ctx=4096, reply=REPLY.encode())
    api = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0)
    kw: Any = {"model": "x", "max_tokens": 512, "messages": MSGS, "tools": ANTHROPIC_TOOLS}
    try:
        r = await api.messages.create(tool_choice={"type": "any"}, **kw)
        assert r.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in r.content if b.type == "tool_use"] == [
            ("get_weather", {"city": "Paris", "days": 2})
        ]
        grammar = engine_of(client).submitted[-1].grammar
        assert grammar is not None and allows(grammar, CALL)  # after the held-back think block
        choice: Any = {"type": "tool", "name": "search", "disable_parallel_tool_use": True}
        await api.messages.create(tool_choice=choice, **kw)
        grammar = engine_of(client).submitted[-1].grammar
        assert grammar is not None and "get_weather" not in grammar.spec.text
        assert "call (" not in grammar.spec.text  # one call, no repetition
    finally:
        await api.close()


def one_tool(param: dict[str, Any]) -> dict[str, Any]:
    """Tools of one function whose one parameter ``a`` has the schema ``param``."""
    params = {"type": "object", "properties": {"a": param}}
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}


REFUSED = [
    ({"response_format": {"type": "json_object"}}, "response_format", "both constrain"),
    (one_tool({"type": "string", "pattern": "^x$"}), "tools", "'pattern'"),
    (one_tool({"type": "integer", "minimum": "x"}), "tools", "invalid tools"),
]


@pytest.mark.parametrize(("extra", "param", "says"), REFUSED)
async def test_refused_forced_calls(make_client: Any, extra: Any, param: str, says: str) -> None:
    client = await make_client(chat_template="qwen3.5", n_ctx=4096, reply=REPLY.encode())
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"} | extra
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == param and says in err["message"], err


# -- the built-in Gemma, writing tool calls only because the grammar makes it --------------------


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3"])
def gemma(request: pytest.FixtureRequest, gemma_path: Path) -> Iterator[Service]:
    yield build_service(
        Settings(model=str(gemma_path), ctx_size=640, parallel=2, chat_template=request.param)
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gemma_client(gemma: Service) -> AsyncIterator[TestClient[Any, Any]]:
    c = TestClient(TestServer(create_app(gemma)))
    await c.start_server()
    yield c
    await c.close()


def check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
async def test_gemma_calls_a_tool_when_forced(
    gemma_client: TestClient[Any, Any], choice: Any
) -> None:
    api = oai(gemma_client)
    kw: Any = {"model": "g", "messages": MSGS, "tools": TOOLS, "tool_choice": choice}
    kw |= {"max_tokens": 80, "temperature": 0, "parallel_tool_calls": False}
    r = await api.chat.completions.create(**kw, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "tool_calls", r
    msg = r.choices[0].message
    assert msg.content is None and msg.tool_calls is not None
    whole = [(c.function.name, c.function.arguments) for c in msg.tool_calls]  # type: ignore[union-attr]
    check_calls(whole, {"search"} if choice == NAMED else set(SCHEMAS))
    stream = await api.chat.completions.create(**kw, stream=True, extra_body=NO_THINKING)
    calls: dict[int, list[str]] = {}
    finish = []
    async for c in stream:
        finish.append(c.choices[0].finish_reason)
        for tc in c.choices[0].delta.tool_calls or []:
            fn = tc.function
            assert fn is not None
            calls.setdefault(tc.index, [fn.name or "", ""])[1] += fn.arguments or ""
    assert finish[-1] == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (n, json.loads(a)) for n, a in whole
    ]  # greedy: the stream is the same answer
    # the loop's second turn: the tool's result goes back and the model answers in text
    call = msg.tool_calls[0]
    turn: Any = [*MSGS, msg.model_dump(exclude_none=True)]
    turn.append({"role": "tool", "tool_call_id": call.id, "content": '{"results": []}'})
    kw |= {"messages": turn, "tool_choice": "none", "max_tokens": 8}
    answer = await api.chat.completions.create(**kw, extra_body=NO_THINKING)
    assert answer.choices[0].finish_reason in ("stop", "length"), answer
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > r.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_gemma_answers_anthropic_any_with_tool_use(
    gemma_client: TestClient[Any, Any],
) -> None:
    url = str(gemma_client.make_url(""))
    api = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
    kw: Any = {"model": "g", "max_tokens": 80, "messages": MSGS, "tools": ANTHROPIC_TOOLS}
    kw |= {"thinking": {"type": "disabled"}, "extra_body": {"temperature": 0}}
    choice: Any = {"type": "any", "disable_parallel_tool_use": True}
    try:
        r = await api.messages.create(tool_choice=choice, **kw)
        async with api.messages.stream(tool_choice=choice, **kw) as stream:
            streamed = await stream.get_final_message()
    finally:
        await api.close()
    for m in (r, streamed):
        assert m.stop_reason == "tool_use", m
        uses = [b for b in m.content if b.type == "tool_use"]
        check_calls([(b.name, json.dumps(b.input)) for b in uses], set(SCHEMAS))
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [
        b.input for b in r.content if b.type == "tool_use"
    ]
