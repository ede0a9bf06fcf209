"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from mgserve.api import fields, sse
from mgserve.api.chat_inputs import chat_inputs
from mgserve.api.errors import ApiError
from mgserve.api.generate import Chunk, Generation, TokenOut
from mgserve.api.http import SERVICE, json_response
from mgserve.api.prompts import chat_prompt, openai_prompt
from mgserve.api.protocol import GenParams, body_size, engine_request, openai_params, read_body
from mgserve.api.service import Service
from mgserve.api.structured import request_grammar
from mgserve.core.engine.contract import Request

FINGERPRINT = "mgserve-0.1.0"


def _text(service: Service, token: int) -> str:
    return bytes(service.tokenizer.piece(token)).decode("utf-8", errors="replace")


def chat_logprobs(service: Service, tokens: list[TokenOut]) -> dict[str, Any]:
    content = []
    for t in tokens:
        content.append(
            {
                "token": t.piece.decode("utf-8", errors="replace"),
                "logprob": t.logprob if t.logprob is not None else 0.0,
                "bytes": list(t.piece),
                "top_logprobs": [
                    {
                        "token": _text(service, c.token),
                        "logprob": c.logprob,
                        "bytes": list(service.tokenizer.piece(c.token)),
                    }
                    for c in t.top
                ],
            }
        )
    return {"content": content}


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
        "top_logprobs": [{_text(service, c.token): c.logprob for c in t.top} for t in tokens],
        "text_offset": offsets,
    }


class _Shape:
    """What differs between chat and completions responses."""

    def __init__(self, service: Service, chat: bool, params: GenParams) -> None:
        self.service = service
        self.chat = chat
        self.params = params
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offset = 0

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

    def choice(
        self,
        text: str,
        tokens: list[TokenOut],
        finish: str | None,
        stream: bool,
        first: bool = False,
    ) -> dict[str, Any]:
        logprobs = None
        if self.params.sampling.want_logprob and tokens:
            logprobs = (
                chat_logprobs(self.service, tokens)
                if self.chat
                else completion_logprobs(self.service, tokens, self.offset)
            )
        self.offset += len(text)
        c: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
        if not self.chat:
            c["text"] = text
        elif first:
            c["delta"] = {"role": "assistant", "content": text}
        elif stream:  # the finishing chunk carries an empty delta, as OpenAI's does
            c["delta"] = {"content": text} if text or finish is None else {}
        else:
            c["message"] = {"role": "assistant", "content": text}
        return c


async def _respond(
    request: web.Request, service: Service, req: Request, params: GenParams, chat: bool
) -> web.StreamResponse:
    shape = _Shape(service, chat, params)
    with Generation(service, req, params, request) as gen:
        if not params.stream:
            text, tokens = await gen.collect()
            body = shape.envelope([shape.choice(text, tokens, gen.finish_reason, False)], False)
            body["usage"] = gen.usage()
            body["timings"] = gen.timings()  # a llama-server extension; clients ignore it
            return json_response(body)
        usage_null = {"usage": None} if params.include_usage else {}

        def chunk(c: Chunk) -> dict[str, Any]:
            return shape.envelope([shape.choice(c.text, c.tokens, None, True)], True) | usage_null

        def closing(c: Chunk) -> list[dict[str, Any]]:
            last = shape.envelope([shape.choice("", [], c.finish_reason, True)], True)
            out = [last | usage_null | {"timings": gen.timings()}]
            if params.include_usage:  # the usage in a chunk of its own, before [DONE]
                out.append(shape.envelope([], True) | {"usage": gen.usage()})
            return out

        opening = []
        if chat:  # a chat stream opens with the role, alone, as OpenAI sends it
            role = shape.choice("", [], None, True, first=True)
            opening.append(shape.envelope([role], True) | usage_null)
        return await sse.stream(request, gen, chunk, closing, opening=opening, done=True)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_body(request, fields.CHAT)
    inputs = chat_inputs(body)
    grammar = await request_grammar(service, body)

    def work() -> tuple[GenParams, Request]:  # render and tokenize: on the text pool
        params = openai_params(body, True, service, grammar)
        return params, engine_request(service, params, chat_prompt(service, inputs), "messages")

    params, req = await service.text.run(await body_size(request), work)
    return await _respond(request, service, req, params, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_body(request, fields.COMPLETIONS)
    if "prompt" not in body:
        raise ApiError("'prompt' is required", param="prompt")
    grammar = await request_grammar(service, body)

    def work() -> tuple[GenParams, Request]:
        params = openai_params(body, False, service, grammar)
        return params, engine_request(service, params, openai_prompt(service, body["prompt"]))

    params, req = await service.text.run(await body_size(request), work)
    return await _respond(request, service, req, params, chat=False)


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
