"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens.

The request is translated into the chat template's inputs (anthropic_inputs.py) and generated as
a chat completion is; the output becomes content blocks (anthropic_blocks.py). A stream is
Anthropic's named events: ``message_start``, ``ping``, the blocks' start / delta / stop events,
``message_delta`` (stop_reason, usage), ``message_stop``; a failure mid-stream is an ``error``
event. Errors are in Anthropic's shape (errors.py).
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

from aiohttp import web

from mgserve.api import fields, sse
from mgserve.api.anthropic_blocks import Blocks, content_of
from mgserve.api.anthropic_inputs import MessagesInput, messages_input
from mgserve.api.chat_response import ChatOutput, chat_output_for
from mgserve.api.generate import Chunk, Generation
from mgserve.api.http import SERVICE, body_size, json_response, read_body
from mgserve.api.message_cuts import message_cuts
from mgserve.api.prompts import encode_text, render_chat
from mgserve.api.protocol import GenParams, anthropic_params
from mgserve.api.reasoning import chat_request, resolve, switch_off
from mgserve.api.service import Service
from mgserve.api.structured import forced_call_spec
from mgserve.core.grammar import GrammarSpec


class _Prompt(NamedTuple):
    ids: list[int]  # the rendered conversation, then the prefill the answer continues
    out: ChatOutput  # how the output is read (reasoning into thinking blocks, calls into tool_use)
    forced: GrammarSpec | None  # tool_choice any / tool: the grammar of the forced calls
    budget: int  # the thinking budget (-1: none)
    hints: tuple[int, ...]  # message cuts (message_cuts.py)


def _prompt(service: Service, body: dict[str, Any]) -> _Prompt:
    inputs: MessagesInput = messages_input(body, "enable_thinking" in service.chat.source)
    budget = resolve(inputs.budget, service)
    chat = switch_off(inputs.chat, budget, service)
    text = render_chat(service, chat) + inputs.prefill
    out = chat_output_for(service, chat, text)
    ids = encode_text(service, text, param="messages")
    hints = message_cuts(service, chat, text, ids)
    return _Prompt(ids, out, forced_call_spec(service, chat, text), budget, hints)


def _stop_reason(gen: Generation, blocks: Blocks, params: GenParams) -> str:
    if gen.finish_reason == "length":
        assert params.max_tokens is not None
        full = gen.n_generated >= params.max_tokens  # else the context ended first
        return "max_tokens" if full else "model_context_window_exceeded"
    if gen.stop_word:
        return "stop_sequence"
    return "tool_use" if blocks.tool_use else "end_turn"


def _usage(gen: Generation) -> dict[str, int]:
    """Anthropic counts the prompt's cached tokens apart: input_tokens are the ones computed."""
    return {
        "input_tokens": gen.n_prompt - gen.n_cached,
        "cache_read_input_tokens": gen.n_cached,
        "output_tokens": gen.n_generated,
    }


def _message(
    service: Service, msg_id: str, content: list[dict[str, Any]], usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": service.model_id,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


async def messages(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_body(request, fields.ANTHROPIC_MESSAGES)

    def work() -> tuple[GenParams, _Prompt]:  # render and tokenize: on the text pool
        return anthropic_params(body, service), _prompt(service, body)

    params, p = await service.text.run(await body_size(request), work)
    params, req = await chat_request(
        service, params, p.ids, p.out, p.forced, p.budget, "messages", p.hints
    )
    out = p.out
    msg_id = "msg_" + uuid.uuid4().hex
    blocks = Blocks(out.parser())
    with Generation(service, req, params, request, keep=out.keep) as gen:
        if not params.stream:
            text, _ = await gen.collect()
            content = content_of(blocks.feed(text) + blocks.finish())
            reply = _message(service, msg_id, content, _usage(gen))
            reply["stop_reason"] = _stop_reason(gen, blocks, params)
            reply["stop_sequence"] = gen.stop_word or None
            return json_response(reply)

        def closing(c: Chunk) -> list[dict[str, Any]]:
            stop = {
                "stop_reason": _stop_reason(gen, blocks, params),
                "stop_sequence": gen.stop_word or None,
            }
            end = {"type": "message_delta", "delta": stop, "usage": _usage(gen)}
            return [*blocks.finish(), end, {"type": "message_stop"}]

        usage = {"input_tokens": gen.n_prompt, "output_tokens": 0}  # before the cache is known
        start = {"type": "message_start", "message": _message(service, msg_id, [], usage)}
        opening = [start, {"type": "ping"}]

        def chunk(c: Chunk) -> list[dict[str, Any]]:
            return blocks.feed(c.text)

        return await sse.stream(request, gen, chunk, closing, opening=opening, named=True)


async def count_tokens(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, fields.ANTHROPIC_COUNT_TOKENS)
    prompt = await service.text.run(await body_size(request), _prompt, service, body)
    return json_response({"input_tokens": len(prompt.ids)})


ROUTES = [
    web.post("/v1/messages", messages),
    web.post("/v1/messages/count_tokens", count_tokens),
]
