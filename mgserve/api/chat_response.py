"""/v1/chat/completions' answer: the generated text read by the chat-output parser.

The parser (chat_output/) splits the text into reasoning, content and tool calls; here they become
OpenAI's ``message`` (``reasoning_content``, ``content``, ``tool_calls``) or, streamed, the
``delta`` chunks OpenAI sends: a tool call opens with a chunk of its index, id, type, name and
empty arguments, then argument fragments follow. ``finish_reason`` is ``tool_calls`` when the
model stopped after calling a tool. The parser's choices (format, reasoning, tools) are made when
the prompt is rendered (``chat_output_for``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from mgserve.api import sse
from mgserve.api.chat_inputs import ChatInputs
from mgserve.api.chat_output import (
    ChatFormat,
    ChatOutputParser,
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from mgserve.api.choices import Choices
from mgserve.api.errors import ApiError
from mgserve.api.generate import Chunk, Generation, TokenOut, piece_text
from mgserve.api.http import json_response
from mgserve.api.protocol import GenParams
from mgserve.api.service import Service
from mgserve.core.engine.contract import Request


class Envelope(Protocol):
    def envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]: ...
    def usage_chunks(self, choices: Choices) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class ChatOutput:
    """How one request's output is read."""

    format: ChatFormat
    reasoning: bool  # split the reasoning out (reasoning format deepseek or auto)
    tools_enabled: bool  # tools given and tool_choice not "none": calls are read
    tools: list[Any] | None
    think_open: bool  # the prompt ends inside a reasoning block
    parallel: bool
    keep: frozenset[int]  # special tokens the parser reads, kept in the detokenized text

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(
            self.format,
            self.reasoning,
            self.tools_enabled,
            tools=self.tools,
            think_open=self.think_open,
            parallel=self.parallel,
        )


def chat_output_for(service: Service, inputs: ChatInputs, prompt: str) -> ChatOutput:
    """The output reading for a request whose rendered prompt is ``prompt``."""
    fmt = service.chat_format
    tools_on = bool(inputs.tools) and inputs.tool_choice != "none"
    if tools_on and fmt.tools == "none":
        raise ApiError(
            f"the chat template ({service.chat.name}) writes no tool calls, so the model's "
            "calls could not be read; serve a template with a tool-call format "
            "(--chat-template) or send tool_choice 'none'",
            param="tools",
        )
    markers = fmt.markers if tools_on else fmt.think or ()
    ids = (service.tokenizer.token_id(m) for m in markers)
    return ChatOutput(
        format=fmt,
        reasoning=(inputs.reasoning_format or service.settings.reasoning_format) != "none",
        tools_enabled=tools_on,
        tools=inputs.tools,
        think_open=fmt.think is not None and prompt.rstrip().endswith(fmt.think[0]),
        parallel=inputs.parallel_tool_calls,
        keep=frozenset(i for i in ids if i is not None),
    )


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
                        "token": piece_text(service, c.token),
                        "logprob": c.logprob,
                        "bytes": list(service.tokenizer.piece(c.token)),
                    }
                    for c in t.top
                ],
            }
        )
    return {"content": content}


def deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Stream deltas: runs of one kind joined; a call's opening chunk stands alone."""
    out: list[dict[str, Any]] = []
    for e in events:
        last = out[-1] if out else {}
        if isinstance(e, ContentDelta | ReasoningDelta):
            key = "content" if isinstance(e, ContentDelta) else "reasoning_content"
            if key in last:
                last[key] += e.text
            else:
                out.append({key: e.text})
        elif isinstance(e, ToolCallStart):
            fn = {"name": e.name, "arguments": ""}
            out.append(
                {
                    "tool_calls": [
                        {"index": e.index, "id": e.id, "type": "function"} | {"function": fn}
                    ]
                }
            )
        elif isinstance(e, ToolCallArgsDelta):
            calls = last.get("tool_calls")
            if calls and calls[0]["index"] == e.index and "id" not in calls[0]:
                calls[0]["function"]["arguments"] += e.text
            else:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out


def message(events: list[Event]) -> dict[str, Any]:
    """The non-streamed ``message``: content null when the model only called tools."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            fn = {"name": e.name, "arguments": ""}
            calls[e.index] = {"id": e.id, "type": "function", "function": fn}
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index]["function"]["arguments"] += e.text
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


async def respond_chat(
    request: web.Request,
    service: Service,
    req: Request,
    params: GenParams,
    out: ChatOutput,
    shape: Envelope,
) -> web.StreamResponse:
    parsers = [out.parser() for _ in range(params.n)]  # one per choice
    want_logprobs = params.sampling.want_logprob

    def finish_reason(gen: Generation) -> str | None:
        calls = parsers[gen.index].has_calls and gen.finish_reason == "stop"
        return "tool_calls" if calls else gen.finish_reason

    def choice(
        index: int, extra: dict[str, Any], tokens: list[TokenOut], finish: str | None
    ) -> dict[str, Any]:
        logprobs = chat_logprobs(service, tokens) if want_logprobs and tokens else None
        return {"index": index, "logprobs": logprobs, "finish_reason": finish} | extra

    with Choices(service, req, params, request, keep=out.keep) as choices:
        if not params.stream:
            answers = await choices.collect()
            body = shape.envelope([], False)
            for gen, parser, (text, tokens) in zip(choices.gens, parsers, answers, strict=True):
                msg = {"message": message(parser.feed(text) + parser.finish())}
                body["choices"].append(choice(gen.index, msg, tokens, finish_reason(gen)))
            body["usage"] = choices.usage()
            body["timings"] = choices.timings()  # a llama-server extension; clients ignore it
            return json_response(body)
        usage_null = {"usage": None} if params.include_usage else {}
        # per choice: tokens whose text its parser still holds (for logprobs)
        pending: list[list[TokenOut]] = [[] for _ in range(params.n)]

        def send(index: int, events: list[Event]) -> list[dict[str, Any]]:
            objs = []
            for d in deltas(events):
                c = choice(index, {"delta": d}, pending[index][:], None)
                pending[index].clear()
                objs.append(shape.envelope([c], True) | usage_null)
            return objs

        def chunk(c: Chunk) -> list[dict[str, Any]]:
            if c.progress is not None:  # return_progress: llama-server's progress chunk
                delta = {"delta": {"role": "assistant", "content": None}}
                obj = shape.envelope([choice(c.index, delta, [], None)], True) | usage_null
                return [obj | {"prompt_progress": c.progress._asdict()}]
            pending[c.index].extend(c.tokens)
            return send(c.index, parsers[c.index].feed(c.text))

        def closing(c: Chunk) -> list[dict[str, Any]]:
            i, gen = c.index, choices.gens[c.index]
            objs = send(i, parsers[i].finish())
            last = choice(i, {"delta": {}}, pending[i], finish_reason(gen))
            objs.append(shape.envelope([last], True) | usage_null | {"timings": gen.timings()})
            return objs

        opening = [
            shape.envelope(
                [choice(i, {"delta": {"role": "assistant", "content": ""}}, [], None)], True
            )
            | usage_null
            for i in range(params.n)
        ]
        ending = functools.partial(shape.usage_chunks, choices)
        return await sse.stream(
            request, choices, chunk, closing, opening=opening, ending=ending, done=True
        )
