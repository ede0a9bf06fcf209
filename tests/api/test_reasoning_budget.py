"""Reasoning budgets through the API (mgserve/api/reasoning.py), on the fake engine: which budget a
request gets (--reasoning-budget, llama-server's thinking_budget_tokens, Anthropic's thinking),
the markers the engine is given, a budget of 0 switching the template's thinking off, and bad
values refused. The engine side: tests/core/test_reasoning.py; a real model:
test_reasoning_served.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.http import SERVICE
from mgserve.core.engine.contract import Request
from mgserve.core.engine.reasoning import ReasoningBudget
from tests.api.fakes import FakeTokenizer

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
OPEN, CLOSE = tuple(b"<think>"), tuple(b"</think>")  # the fake tokenizer is byte-level


async def chat(client: TestClient[Any, Any], **body: Any) -> Request:
    """Post a chat request; the Request the engine got."""
    resp = await client.post(CHAT, json={"messages": USER, "max_tokens": 4} | body)
    assert resp.status == 200, await resp.text()
    return client.server.app[SERVICE].engine.submitted[-1]  # type: ignore[attr-defined, no-any-return]


def prompt_text(req: Request) -> str:
    return FakeTokenizer().decode(req.prompt[1:])


async def test_the_server_budget_and_a_requests_own(make_client: Callable[..., Any]) -> None:
    client = await make_client(chat_template="qwen3.5", n_ctx=2048, reasoning_budget=5)
    req = await chat(client)  # Qwen 3.5's prompt opens the block; its template closes it so
    assert req.reasoning == ReasoningBudget(5, OPEN, CLOSE, CLOSE + (10, 10), True)
    for name in ("thinking_budget_tokens", "reasoning_budget_tokens"):
        assert (await chat(client, **{name: 3})).reasoning.budget == 3  # type: ignore[union-attr]
        assert (await chat(client, **{name: -1})).reasoning.budget == 5  # type: ignore[union-attr]
    both = {"thinking_budget_tokens": 0, "reasoning_budget_tokens": 0}
    assert (await chat(client, **both)).reasoning.budget == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"thinking_budget_tokens": -2}, "thinking_budget_tokens", "must be in [-1, inf]"),
        ({"thinking_budget_tokens": "8"}, "thinking_budget_tokens", "must be an integer"),
        (
            {"thinking_budget_tokens": 8, "reasoning_budget_tokens": 9},
            "reasoning_budget_tokens",
            "disagree",
        ),
    ],
)
async def test_bad_budgets_are_refused(
    make_client: Callable[..., Any], body: dict[str, Any], param: str, message: str
) -> None:
    client = await make_client(chat_template="qwen3.5", n_ctx=2048)
    resp = await client.post(CHAT, json={"messages": USER} | body)
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == param and message in err["message"], err


async def test_budget_zero_switches_thinking_off(make_client: Callable[..., Any]) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=2048)
    req = await chat(client, thinking_budget_tokens=0)
    assert prompt_text(req).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert req.reasoning == ReasoningBudget(0, OPEN, CLOSE, CLOSE + (10, 10), False)
    # a request that asks for thinking keeps it, and the engine still holds the budget to 0
    on = {"enable_thinking": True}
    req = await chat(client, thinking_budget_tokens=0, chat_template_kwargs=on)
    assert prompt_text(req).endswith("<|im_start|>assistant\n")
    assert req.reasoning is not None and req.reasoning.budget == 0
    # the server's budget of 0: chat and /apply-template render the same prompt
    client = await make_client(chat_template="qwen3", n_ctx=2048, reasoning_budget=0)
    req = await chat(client)
    rendered = await client.post("/apply-template", json={"messages": USER})
    assert (await rendered.json())["prompt"] == prompt_text(req)
    assert prompt_text(req).endswith("<think>\n\n</think>\n\n")


async def test_what_the_engine_is_given(make_client: Callable[..., Any]) -> None:
    gemma = await make_client(n_ctx=2048)  # no reasoning block: nothing to hold
    assert (await chat(gemma, thinking_budget_tokens=3)).reasoning is None
    client = await make_client(chat_template="qwen3.5", n_ctx=2048)
    assert (await chat(client)).reasoning is None  # no budget, no grammar
    # a grammar waits for the block the prompt opened to close, with or without a budget
    fmt = {"type": "json_object"}
    req = await chat(client, response_format=fmt)
    assert req.grammar is not None and req.reasoning is not None
    assert req.reasoning.budget == -1 and req.reasoning.opened


async def test_anthropic_thinking_sets_the_budget(make_client: Callable[..., Any]) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=4096, reasoning_budget=7)

    async def message(**body: Any) -> Request:
        resp = await client.post("/v1/messages", json={"messages": USER} | body)
        assert resp.status == 200, await resp.text()
        return client.server.app[SERVICE].engine.submitted[-1]  # type: ignore[no-any-return]

    enabled = {"type": "enabled", "budget_tokens": 1024}
    req = await message(max_tokens=2048, thinking=enabled)
    assert req.reasoning is not None and req.reasoning.budget == 1024
    assert prompt_text(req).endswith("<|im_start|>assistant\n")
    req = await message(max_tokens=8, thinking={"type": "disabled"})
    assert req.reasoning is not None and req.reasoning.budget == 0
    assert prompt_text(req).endswith("<think>\n\n</think>\n\n")
    for thinking in (None, {"type": "adaptive"}):  # the server's
        req = await message(max_tokens=8, thinking=thinking)
        assert req.reasoning is not None and req.reasoning.budget == 7


def test_the_setting_as_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from mgserve.config import Settings, add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from(parser.parse_args(["--reasoning-budget", "0"])).reasoning_budget == 0
    monkeypatch.setenv("MGSERVE_REASONING_BUDGET", "12")
    assert settings_from(parser.parse_args([])).reasoning_budget == 12
    with pytest.raises(ValueError, match="reasoning-budget must be >= -1"):
        Settings(reasoning_budget=-2)
