"""llama-server's native routes: /completion, /infill (its prompt: infill.py), /tokenize,
/detokenize, /apply-template, /health, /props, /slots, /metrics. Field names follow llama.cpp's
tools/server of the vendored version."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from mgserve import __version__ as VERSION
from mgserve.api import fields, sse
from mgserve.api.chat_inputs import chat_inputs
from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields
from mgserve.api.generate import Chunk, Generation, TokenOut
from mgserve.api.http import SERVICE, body_size, json_response, read_body
from mgserve.api.infill import check_model, infill_inputs, infill_prompt
from mgserve.api.prompts import check_ids, llama_prompt, mixed_prompt, render_chat
from mgserve.api.protocol import GenParams, engine_request, llama_params
from mgserve.api.reasoning import switch_off
from mgserve.api.service import Service
from mgserve.api.structured import request_grammar
from mgserve.core.engine.contract import Request

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
STOP_TYPE = {"stop": "eos", "length": "limit"}  # a stop string gives "word"; anything else "none"


def _valid_prefix(piece: bytes) -> str:
    # llama-server cuts a token's text at its last complete UTF-8 character
    return piece.decode("utf-8", errors="ignore")


def _probs(service: Service, tokens: list[TokenOut]) -> list[dict[str, Any]]:
    tok = service.tokenizer
    out = []
    for t in tokens:
        top = []
        for c in t.top:
            piece = bytes(tok.piece(c.token))
            top.append(
                {
                    "id": c.token,
                    "token": _valid_prefix(piece),
                    "bytes": list(piece),
                    "logprob": c.logprob,
                }
            )
        out.append(
            {
                "id": t.id,
                "token": _valid_prefix(t.piece),
                "bytes": list(t.piece),
                "logprob": t.logprob if t.logprob is not None else 0.0,
                "top_logprobs": top,
            }
        )
    return out


def _settings(service: Service, params: GenParams) -> dict[str, Any]:
    d = params.sampling.as_json()
    d.update(
        n_predict=params.max_tokens or service.settings.n_predict,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        stream=params.stream,
    )
    d["speculative.n_max"] = (
        service.settings.spec_k if params.draft_max is None else params.draft_max
    )
    d["speculative.n_min"] = params.draft_min
    return {"n_ctx": service.engine.n_ctx, "params": d}


async def completion(request: web.Request) -> web.StreamResponse:
    body = await read_body(request, fields.LLAMA_COMPLETION)
    if "prompt" not in body:
        raise ApiError("'prompt' is required", param="prompt")
    return await _complete(request, body, lambda service, _: llama_prompt(service, body["prompt"]))


async def infill(request: web.Request) -> web.StreamResponse:
    fim = check_model(request.app[SERVICE])  # before the body, as llama-server does
    body = await read_body(request, fields.INFILL)
    inputs = infill_inputs(body)
    return await _complete(request, body, lambda s, p: infill_prompt(s, fim, inputs, p))


async def _complete(
    request: web.Request,
    body: dict[str, Any],
    build_prompt: Callable[[Service, GenParams], list[int]],
) -> web.StreamResponse:
    """/completion's answer to ``body``, whose prompt ``build_prompt`` makes (on the text pool)."""
    service = request.app[SERVICE]
    return_tokens = Fields(body).get_bool("return_tokens", False)
    grammar = await request_grammar(service, body)

    def work() -> tuple[GenParams, Request, str]:  # on the text pool
        params = llama_params(body, service, grammar)
        prompt = build_prompt(service, params)
        req = engine_request(service, params, prompt)
        return params, req, service.tokenizer.decode(prompt)  # the text the response echoes

    params, req, prompt_text = await service.text.run(await body_size(request), work)
    gen = Generation(service, req, params, request)

    def partial(text: str, tokens: list[TokenOut]) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "index": 0,
            "content": text,
            "tokens": [t.id for t in tokens] if return_tokens else [],
            "stop": False,
            "id_slot": gen.slot,
            "tokens_predicted": gen.n_generated,
            "tokens_evaluated": gen.n_prompt,
        }
        if req.sampling.n_probs and tokens:
            obj["completion_probabilities"] = _probs(service, tokens)
        return obj

    def final(text: str, tokens: list[TokenOut]) -> dict[str, Any]:
        reason = gen.finish_reason or ""
        return partial(text, tokens) | {
            "stop": True,
            "model": service.model_id,
            "generation_settings": _settings(service, params),
            "prompt": prompt_text,
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": "word" if gen.stop_word else STOP_TYPE.get(reason, "none"),
            "stopping_word": gen.stop_word,
            "tokens_cached": gen.n_prompt + gen.n_generated,
            "timings": gen.timings(),
        }

    def chunk(c: Chunk) -> list[dict[str, Any]]:
        obj = partial(c.text, c.tokens)
        if c.progress is not None:  # return_progress
            obj["prompt_progress"] = c.progress._asdict()
        return [obj]

    with gen:
        if not params.stream:
            return json_response(final(*await gen.collect()))
        return await sse.stream(request, gen, chunk, lambda c: [final("", [])])


async def tokenize(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, fields.TOKENIZE)
    f = Fields(body)
    add_special = f.get_bool("add_special", False)
    parse_special = f.get_bool("parse_special", True)
    with_pieces = f.get_bool("with_pieces", False)
    content = body.get("content")
    if content is None:
        return json_response({"tokens": []})
    if not isinstance(content, str | list):
        raise ApiError("'content' must be a string or a list", param="content")

    def work() -> list[Any]:  # no context limit here: counting tokens of any text is a use
        if isinstance(content, str):
            ids = service.tokenizer.encode(
                content, add_special=add_special, parse_special=parse_special
            )
        else:
            ids = mixed_prompt(service, content, "content", limit=False)
        return ids if not with_pieces else [_with_piece(service, t) for t in ids]

    return json_response({"tokens": await service.text.run(await body_size(request), work)})


def _with_piece(service: Service, token: int) -> dict[str, Any]:
    piece = bytes(service.tokenizer.piece(token))
    try:
        shown: str | list[int] = piece.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: llama-server sends the raw bytes
        shown = list(piece)
    return {"id": token, "piece": shown}


async def detokenize(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, fields.DETOKENIZE)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError("'tokens' must be a list of token ids", param="tokens")
    check_ids(tokens, service.n_vocab, "tokens")
    text = await service.text.run(await body_size(request), service.tokenizer.decode, tokens)
    return json_response({"content": text})


async def apply_template(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, fields.APPLY_TEMPLATE)
    # what a chat request renders: thinking off under a server budget of 0
    inputs = switch_off(chat_inputs(body), service.settings.reasoning_budget, service)
    prompt = await service.text.run(await body_size(request), render_chat, service, inputs)
    return json_response({"prompt": prompt})


async def health(request: web.Request) -> web.Response:
    """200 ok; 503 "shutting down" once a signal began the drain (api/drain.py), so a load
    balancer stops sending while the requests in flight finish."""
    if request.app[SERVICE].drain.closed:
        return json_response({"status": "shutting down"}, status=503)
    return json_response({"status": "ok"})


async def props(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return json_response(
        {
            # what a request that sets nothing gets
            "default_generation_settings": _settings(service, llama_params({}, service)),
            "total_slots": service.engine.n_slots,
            "model_alias": service.model_id,
            "model_path": service.model_path,
            "n_ctx": service.engine.n_ctx,
            "n_ctx_train": service.n_ctx_train,
            "chat_template": service.chat.source,
            "chat_template_name": service.chat.name,
            "bos_token": service.chat.bos_token,
            "eos_token": service.chat.eos_token,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"mgserve {VERSION}",
        }
    )


async def slots(request: web.Request) -> web.Response:
    """Every slot's state (``Slot.info``); with ``?fail_on_no_slot`` (any value, as llama-server)
    a 503 when none is free."""
    for name in request.query:
        if name != "fail_on_no_slot":
            raise ApiError(f"unknown query parameter {name!r}", param=name)
    info = request.app[SERVICE].engine.slots()
    if "fail_on_no_slot" in request.query and all(s["is_processing"] for s in info):
        raise ApiError("no slot available", status=503)
    return json_response(info)


async def metrics(request: web.Request) -> web.Response:
    """The engine's registry (metrics.py) in Prometheus' text format 0.0.4, as llama-server. Not
    OpenMetrics, whatever ``Accept`` asks: prometheus-client escapes the ``llamacpp:`` names there
    in the samples but not in their HELP and TYPE lines, which scrapers reject."""
    return web.Response(
        body=generate_latest(request.app[SERVICE].engine.metrics.registry),
        headers={"Content-Type": PROMETHEUS_TEXT, "X-Content-Type-Options": "nosniff"},
    )


# the route table (openai_routes.ROUTES has the same form); llama-server also answers
# /completions and /v1/health
ROUTES = [
    web.post("/completion", completion),
    web.post("/completions", completion),
    web.post("/infill", infill),
    web.post("/tokenize", tokenize),
    web.post("/detokenize", detokenize),
    web.post("/apply-template", apply_template),
    web.get("/health", health),
    web.get("/v1/health", health),
    web.get("/props", props),
    web.get("/slots", slots),
    web.get("/metrics", metrics),
]
