"""OpenAI's Responses API: POST /v1/responses, whole or streamed.

The request is translated into the chat template's inputs (responses_inputs.py) and generated as
a chat completion is; the output becomes output items: reasoning, message, function_call
(responses_output.py). A stream is the Responses API's named events: ``response.created``,
``response.in_progress``, the items' events, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short) carrying the whole response and
its usage; a failure mid-stream ends it with ``response.failed``. Every event has a
``sequence_number``. Nothing is stored: a response cannot be fetched, continued or cancelled
later. Errors are in OpenAI's shape.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from aiohttp import web

from mgserve.api import fields, sse
from mgserve.api.chat_response import ChatOutput, chat_output_for
from mgserve.api.errors import ApiError
from mgserve.api.generate import Chunk, Generation
from mgserve.api.http import SERVICE, body_size, json_response, read_body
from mgserve.api.message_cuts import message_cuts
from mgserve.api.prompts import encode_text, render_chat
from mgserve.api.protocol import GenParams, responses_params
from mgserve.api.reasoning import chat_request
from mgserve.api.responses_inputs import ResponsesInput, responses_input
from mgserve.api.responses_output import Items
from mgserve.api.service import Service
from mgserve.api.structured import forced_call_spec, request_grammar
from mgserve.core.grammar import GrammarSpec


class _Response:
    """The response object: what the request set, echoed, then its output, status and usage."""

    def __init__(
        self, service: Service, body: dict[str, Any], params: GenParams, inputs: ResponsesInput
    ) -> None:
        text = body.get("text") or {}
        self.head = {
            "id": "resp_" + uuid.uuid4().hex,
            "object": "response",
            "created_at": int(time.time()),
        }
        self.settings = {
            "instructions": body.get("instructions"),
            "max_output_tokens": params.max_tokens,
            "metadata": body.get("metadata") or {},
            "model": service.model_id,
            "parallel_tool_calls": inputs.chat.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": inputs.effort, "summary": None},
            "store": False,
            "temperature": params.sampling.temperature,
            "text": {
                "format": text.get("format") or {"type": "text"},
                "verbosity": text.get("verbosity") or "medium",
            },
            "tool_choice": inputs.chat.tool_choice,
            "tools": body.get("tools") or [],
            "top_p": params.sampling.top_p,
            "truncation": "disabled",
            "user": body.get("user"),
        }

    def body(
        self,
        status: str,
        items: Items,
        usage: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        cut = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            **self.head,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": cut,
            "output": items.output,
            "usage": usage,
            **self.settings,
        }

    def final(self, gen: Generation, items: Items) -> dict[str, Any]:
        """The finished response (``items`` finished with the same status)."""
        usage = {
            "input_tokens": gen.n_prompt,
            "input_tokens_details": {"cached_tokens": gen.n_cached},
            "output_tokens": gen.n_generated,
            "output_tokens_details": {"reasoning_tokens": items.reasoning_tokens},
            "total_tokens": gen.n_prompt + gen.n_generated,
        }
        return self.body(_status(gen), items, usage)


def _status(gen: Generation) -> str:
    """``completed``, or ``incomplete`` when the output hit its limit (``max_output_tokens``, or
    the context's end, which bounds it when none was given)."""
    return "completed" if gen.finish_reason == "stop" else "incomplete"


def _prepare(
    service: Service, body: dict[str, Any], inputs: ResponsesInput, grammar: Any
) -> tuple[GenParams, list[int], ChatOutput, GrammarSpec | None, tuple[int, ...]]:
    """Render and tokenize (on the text pool): the parameters, the prompt's ids, how the output
    is read, the grammar of forced tool calls (None when none are forced) and the message cuts
    (message_cuts.py)."""
    params = responses_params(body, service, grammar)
    text = render_chat(service, inputs.chat)
    out = chat_output_for(service, inputs.chat, text)
    ids = encode_text(service, text, param="input")
    hints = message_cuts(service, inputs.chat, text, ids)
    return params, ids, out, forced_call_spec(service, inputs.chat, text), hints


async def responses(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = await read_body(request, fields.RESPONSES)
    switch = "enable_thinking" in service.chat.source
    inputs = responses_input(body, switch, service.chat_format.think is not None)
    grammar = await request_grammar(service, body, forced=inputs.chat.tool_choice == "required")
    size = await body_size(request)
    params, ids, out, forced, hints = await service.text.run(
        size, _prepare, service, body, inputs, grammar
    )
    budget = service.settings.reasoning_budget  # the server's: Responses has no budget field
    params, req = await chat_request(service, params, ids, out, forced, budget, "input", hints)
    shape = _Response(service, body, params, inputs)
    items = Items(out.parser())
    with Generation(service, req, params, request, keep=out.keep) as gen:
        if not params.stream:
            async for c in gen.chunks():
                items.feed(c.text, len(c.tokens))
            if gen.finish_reason == "error":
                raise ApiError(gen.failure, status=500)
            items.finish(_status(gen))
            return json_response(shape.final(gen, items))

        numbers = itertools.count()

        def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [ev | {"sequence_number": next(numbers)} for ev in events]

        def chunk(c: Chunk) -> list[dict[str, Any]]:
            return numbered(items.feed(c.text, len(c.tokens)))

        def closing(c: Chunk) -> list[dict[str, Any]]:
            events = items.finish(_status(gen))
            final = shape.final(gen, items)
            return numbered([*events, {"type": "response." + final["status"], "response": final}])

        def failed(message: str) -> list[dict[str, Any]]:
            error = {"code": "server_error", "message": message}
            return numbered(
                [{"type": "response.failed", "response": shape.body("failed", items, error=error)}]
            )

        opening = numbered(
            [
                {"type": kind, "response": shape.body("in_progress", items)}
                for kind in ("response.created", "response.in_progress")
            ]
        )
        return await sse.stream(
            request, gen, chunk, closing, opening=opening, named=True, failed=failed
        )


ROUTES = [web.post("/v1/responses", responses)]
