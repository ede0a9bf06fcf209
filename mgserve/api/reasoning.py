"""Reasoning budgets: ``--reasoning-budget`` and a request's own -> what the engine enforces.

A budget is llama-server's: -1 no limit, 0 no reasoning, N > 0 at most N tokens inside the
reasoning block, after which the engine writes the close marker itself and the answer follows
(core/engine/reasoning.py). A chat request sets its own with llama-server's
``thinking_budget_tokens`` (also read as ``reasoning_budget_tokens``, the name other llama-server
builds and their clients use); -1 or absent is the server's. Anthropic's ``thinking`` gives its
own (anthropic_inputs.py).

A budget of 0 also switches the template's thinking off (``enable_thinking: false``) where the
template has that switch and the request did not set it; the engine holds it to 0 either way. A
template without a reasoning block has nothing to limit: the budget holds trivially there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mgserve.api.chat_inputs import ChatInputs
from mgserve.api.chat_response import ChatOutput
from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields
from mgserve.api.protocol import GenParams, engine_request
from mgserve.api.service import Service
from mgserve.api.structured import compile_grammar
from mgserve.core.engine.contract import Request
from mgserve.core.engine.reasoning import ReasoningBudget
from mgserve.core.grammar import Grammar, GrammarSpec

FIELDS = ("thinking_budget_tokens", "reasoning_budget_tokens")


def resolve(asked: int, service: Service) -> int:
    """A request's budget, or the server's where it asks for none (-1)."""
    return asked if asked >= 0 else service.settings.reasoning_budget


def request_budget(body: dict[str, Any], service: Service) -> int:
    """A chat request's budget (FIELDS), resolved; the two names may not disagree."""
    f = Fields(body)
    asked = {name: f.get_int(name, -1, lo=-1) for name in FIELDS if f.has(name)}
    if len(set(asked.values())) > 1:
        raise ApiError(f"'{FIELDS[0]}' and '{FIELDS[1]}' disagree; give one", param=FIELDS[1])
    return resolve(next(iter(asked.values()), -1), service)


def switch_off(inputs: ChatInputs, budget: int, service: Service) -> ChatInputs:
    """``inputs`` with the template's thinking off when the budget is 0 (unless it was set)."""
    if budget or "enable_thinking" not in service.chat.source or "enable_thinking" in inputs.kwargs:
        return inputs
    return replace(inputs, kwargs={**inputs.kwargs, "enable_thinking": False})


def engine_budget(
    service: Service, out: ChatOutput, budget: int, grammar: Grammar | None
) -> ReasoningBudget | None:
    """The engine's view of a chat request read as ``out``: None where the template has no
    reasoning block, or where there is neither a budget nor a grammar to hold back."""
    think = out.format.think
    if think is None or (budget < 0 and grammar is None):
        return None
    opening, closing = (_ids(service, m) for m in think)
    # the close marker as the template writes it: followed by a blank line where it is
    blank = f"{think[1]}\\n\\n" in service.chat.source or f"{think[1]}\n\n" in service.chat.source
    forced = closing + _ids(service, "\n\n") if blank else closing
    return ReasoningBudget(budget, opening, closing, forced, out.think_open)


async def chat_request(
    service: Service,
    params: GenParams,
    ids: list[int],
    out: ChatOutput,
    forced: GrammarSpec | None,
    budget: int,
    param: str,
    hints: tuple[int, ...] = (),
) -> tuple[GenParams, Request]:
    """A chat-shaped route's engine request for prompt ``ids`` read as ``out``: the grammar of
    forced calls (``forced``) compiled off the loop into ``params``, and the reasoning budget the
    engine enforces (it holds the grammar back while a block the prompt opened is open);
    ``hints``: the prompt's message cuts (api/message_cuts.py)."""
    if forced is not None:
        params = replace(params, grammar=await compile_grammar(service, forced, "tools"))
    reasoning = engine_budget(service, out, budget, params.grammar)
    return params, engine_request(service, params, ids, param, reasoning, hints)


def _ids(service: Service, text: str) -> tuple[int, ...]:
    return tuple(service.tokenizer.encode(text, add_special=False, parse_special=True))
