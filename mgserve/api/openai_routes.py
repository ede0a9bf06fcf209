"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from aiohttp import web

from mgserve.api import fields, sse
from mgserve.api.chat_inputs import chat_inputs
from mgserve.api.chat_response import ChatOutput, chat_output_for, respond_chat
from mgserve.api.choices import Choices
from mgserve.api.errors import ApiError
from mgserve.api.generate import Chunk, TokenOut, piece_text
from mgserve.api.http import SERVICE, body_size, json_response, read_body
from mgserve.api.message_cuts import message_cuts
from mgserve.api.prompts import echo_text, encode_text, openai_prompt, render_chat
from mgserve.api.protocol import GenParams, engine_request, openai_params
from mgserve.api.reasoning import chat_request, request_budget, switch_off
from mgserve.api.service import Service
from mgserve.api.structured import forced_call_spec, request_grammar
from mgserve.core.engine.contract import Request
from mgserve.core.grammar import GrammarSpec

FINGERPRINT = "mgserve-0.1.0"


def completion_logprobs(service: Service, tokens: list[TokenOut], offset: int) -> dict[str, Any]:
    """The legacy completions shape; ``offset`` is where this chunk's text starts."""
    texts = [t.piece.decode("utf-8", errors="replace") for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob if t.logprob is not None else 0.0 for t in tokens],
        "top_logprobs": [{piece_text(service, c.token): c.logprob for c in t.top} for t in tokens],
        "text_offset": offsets,
    }


class _Shape:
    """The response envelope of both routes, and the completions choice."""

    def __init__(self, service: Service, chat: bool, params: GenParams) -> None:
        self.service = service
        self.chat = chat
        self.params = params
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offsets = [0] * params.n  # per choice: where its next text starts (logprobs)

    def envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj + (".chunk" if stream and self.chat else ""),
            "created": self.created,
            "model": self.service.model_id,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
        }

    def usage_chunks(self, choices: Choices) -> list[dict[str, Any]]:
        """Streamed with include_usage: the usage in a chunk of its own, before [DONE]."""
        if not self.params.include_usage:
            return []
        return [self.envelope([], True) | {"usage": choices.usage()}]

    def choice(
        self, index: int, text: str, tokens: list[TokenOut], finish: str | None
    ) -> dict[str, Any]:
        """A completions choice (chat choices: chat_response.py)."""
        logprobs = None
        if self.params.sampling.want_logprob and tokens:
            logprobs = completion_logprobs(self.service, tokens, self.offsets[index])
        self.offsets[index] += len(text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


async def _respond_completion(
    request: web.Request, service: Service, req: Request, params: GenParams, echo: str
) -> web.StreamResponse:
    """``echo``: text that starts every choice's answer (the prompt, with ``echo``; else empty)."""
    shape = _Shape(service, False, params)
    with Choices(service, req, params, request) as choices:
        if not params.stream:
            answers = await choices.collect()
            body = shape.envelope(
                [
                    shape.choice(g.index, echo + text, tokens, g.finish_reason)
                    for g, (text, tokens) in zip(choices.gens, answers, strict=True)
                ],
                False,
            )
            body["usage"] = choices.usage()
            body["timings"] = choices.timings()  # a llama-server extension; clients ignore it
            return json_response(body)
        usage_null = {"usage": None} if params.include_usage else {}

        def chunk(c: Chunk) -> list[dict[str, Any]]:
            obj = shape.envelope([shape.choice(c.index, c.text, c.tokens, None)], True) | usage_null
            if c.progress is not None:  # return_progress
                obj["prompt_progress"] = c.progress._asdict()
            return [obj]

        def closing(c: Chunk) -> list[dict[str, Any]]:
            gen = choices.gens[c.index]
            last = shape.envelope([shape.choice(c.index, "", [], c.finish_reason)], True)
            return [last | usage_null | {"timings": gen.timings()}]

        opening = [
            shape.envelope([shape.choice(i, echo, [], None)], True) | usage_null
            for i in range(params.n)
            if echo
        ]
        ending = functools.partial(shape.usage_chunks, choices)
        return await sse.stream(
            request, choices, chunk, closing, opening=opening, ending=ending, done=True
        )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_body(request, fields.CHAT)
    budget = request_budget(body, service)
    inputs = switch_off(chat_inputs(body), budget, service)
    grammar = await request_grammar(service, body, forced=inputs.tool_choice == "required")

    def work() -> tuple[GenParams, list[int], ChatOutput, GrammarSpec | None, tuple[int, ...]]:
        # render and tokenize: on the text pool
        params = openai_params(body, True, service, grammar)
        text = render_chat(service, inputs)
        out = chat_output_for(service, inputs, text)
        ids = encode_text(service, text, param="messages")
        hints = message_cuts(service, inputs, text, ids)
        return params, ids, out, forced_call_spec(service, inputs, text), hints

    params, ids, out, forced, hints = await service.text.run(await body_size(request), work)
    params, req = await chat_request(service, params, ids, out, forced, budget, "messages", hints)
    return await respond_chat(request, service, req, params, out, _Shape(service, True, params))


async def completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_body(request, fields.COMPLETIONS)
    if "prompt" not in body:
        raise ApiError("'prompt' is required", param="prompt")
    grammar = await request_grammar(service, body)

    def work() -> tuple[GenParams, Request, str]:
        params = openai_params(body, False, service, grammar)
        ids = openai_prompt(service, body["prompt"])
        echo = echo_text(service, body["prompt"], ids) if params.echo else ""
        return params, engine_request(service, params, ids), echo

    params, req, echo = await service.text.run(await body_size(request), work)
    return await _respond_completion(request, service, req, params, echo)


async def models(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": service.model_id,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "mgserve",
                    "meta": {
                        "n_ctx_train": service.n_ctx_train,
                        "n_vocab": service.n_vocab,
                        "architecture": service.architecture,
                    },
                }
            ],
        }
    )


# the route table (llama_routes.ROUTES has the same form); the paths without /v1 are served
# too, as llama-server does
ROUTES = [
    web.post("/v1/chat/completions", chat_completions),
    web.post("/chat/completions", chat_completions),
    web.post("/v1/completions", completions),
    web.get("/v1/models", models),
    web.get("/models", models),
]
