"""Request bodies -> typed generation parameters -> the ``Request`` the engine runs.

Every field is type- and range-checked here, once, and every default resolved here (the seed,
``max_tokens``, the sampling stages): anything wrong raises ``ApiError`` (HTTP 400, OpenAI's error
shape, ``param`` naming the field), so handlers never see an unchecked value and the engine checks
nothing again. Every dialect lands on one ``GenParams``: OpenAI's names (``max_tokens``,
``logprobs``/``top_logprobs``, the Responses API's ``max_output_tokens``), llama-server's
(``n_predict``, ``n_probs``) and Anthropic's (``stop_sequences``); the grammar fields are read by
``structured.py``.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields, is_number
from mgserve.api.prompts import encode_text
from mgserve.api.service import Service
from mgserve.core.engine.contract import MAX_N_PROBS, Request, SamplingParams
from mgserve.core.engine.reasoning import ReasoningBudget
from mgserve.core.grammar import Grammar

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs


@dataclass(frozen=True)
class GenParams:
    """One validated generation request, before the prompt is attached."""

    sampling: SamplingParams  # n_probs and want_logprob say what the response reports
    max_tokens: int | None  # None: the server's default (--n-predict, else to the context end)
    stop: tuple[str, ...]  # stop strings, matched on detokenized text by the API
    ignore_eos: bool
    stream: bool
    include_usage: bool  # OpenAI stream_options.include_usage: a usage chunk before [DONE]
    grammar: Grammar | None = None  # structured output (api/structured.py)
    echo: bool = False  # /v1/completions: the prompt's text starts the answer
    n: int = 1  # OpenAI's choices per request, each its own slot (choices.py)


def _logit_bias(f: Fields, service: Service) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"id": bias} or llama-server's [[id_or_text, bias_or_false], ...]."""
    n_vocab = service.n_vocab
    raw = f.body.get("logit_bias")
    if raw is None:
        return ()
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        items = [(p[0], p[1]) for p in raw]
    else:
        raise ApiError(
            "'logit_bias' must be an object {token_id: bias} or a list of [token, bias] pairs",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    for key, bias in items:
        if bias is False:
            value = -math.inf
        elif is_number(bias):
            value = float(bias)
        else:
            raise ApiError(f"logit_bias for {key!r} must be a number or false", param="logit_bias")
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and key.lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str) and isinstance(raw, list):
            # llama-server biases every token of a text key (tokenized without BOS)
            ids = encode_text(service, key, add_special=False, param="logit_bias")
        else:
            raise ApiError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        for t in ids:
            if not 0 <= t < n_vocab:
                raise ApiError(
                    f"logit_bias token id {t} is outside the vocabulary (0..{n_vocab - 1})",
                    param="logit_bias",
                )
            out[t] = value
    return tuple(sorted(out.items()))


def _stop(f: Fields, name: str = "stop") -> tuple[str, ...]:
    raw = f.body.get(name)
    if raw is None:
        return ()
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise ApiError(f"'{name}' must be a string or a list of strings", param=name)
    if len(raw) > MAX_STOP_STRINGS:
        raise ApiError(
            f"'{name}' has {len(raw)} strings; at most {MAX_STOP_STRINGS} are allowed", param=name
        )
    return tuple(s for s in raw if s)


def _max_tokens(f: Fields, names: tuple[str, ...], n_ctx: int) -> int | None:
    for name in names:
        if not f.has(name):
            continue
        v = f.get_int(name, 0)
        if name == "n_predict" and v == -1:  # llama-server: generate until the context ends
            return None
        if v < 1 or v > n_ctx:
            raise ApiError(
                f"'{name}' must be in [1, {n_ctx}] (the context size), got {v}", param=name
            )
        return v
    return None


def _sampling(f: Fields, service: Service, n_probs: int, logprobs: bool) -> SamplingParams:
    d = SamplingParams()
    seed = f.get_int("seed", -1)
    if seed < 0:
        seed = service.settings.seed  # --seed, the server's default (-1: random per request)
    top_p = f.get_float("top_p", d.top_p)
    if not 0.0 < top_p <= 1.0:
        raise ApiError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    return SamplingParams(
        temperature=f.get_float("temperature", d.temperature, lo=0.0),
        top_k=f.get_int("top_k", d.top_k, lo=0),
        top_p=top_p,
        min_p=f.get_float("min_p", d.min_p, lo=0.0, hi=1.0),
        repeat_penalty=f.get_float("repeat_penalty", d.repeat_penalty, lo=0.0),
        repeat_last_n=f.get_int("repeat_last_n", d.repeat_last_n, lo=-1),
        presence_penalty=f.get_float("presence_penalty", d.presence_penalty, lo=-2.0, hi=2.0),
        frequency_penalty=f.get_float("frequency_penalty", d.frequency_penalty, lo=-2.0, hi=2.0),
        seed=None if seed < 0 else seed,
        logit_bias=_logit_bias(f, service),
        n_probs=n_probs,
        want_logprob=logprobs,
    )


def _check_n(f: Fields) -> None:
    if f.get_int("n", 1) != 1:
        raise ApiError("only n=1 is supported here (one completion per request)", param="n")


def _n(f: Fields, n_slots: int) -> int:
    """OpenAI's ``n``: each choice takes a slot of its own, so at most the server's slots."""
    n = f.get_int("n", 1)
    if not 1 <= n <= n_slots:
        raise ApiError(
            f"'n' must be in [1, {n_slots}] (the server's slots, --parallel), got {n}", param="n"
        )
    return n


def openai_params(
    body: dict[str, Any], chat: bool, service: Service, grammar: Grammar | None = None
) -> GenParams:
    """/v1/chat/completions (chat=True) or /v1/completions; ``grammar``: structured.py's."""
    f = Fields(body)
    n = _n(f, service.engine.n_slots)
    if chat:
        logprobs = f.get_bool("logprobs", False)
        top = f.get_int("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise ApiError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        names: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
        echo = False
    else:
        top = f.get_int("logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        logprobs = f.has("logprobs")
        echo = f.get_bool("echo", False)
        if echo and logprobs:
            raise ApiError(
                "'echo' with 'logprobs' is not supported (the prompt's logprobs are not computed)",
                param="echo",
            )
        names = ("max_tokens",)
    stream = f.get_bool("stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    include_usage = Fields(opts or {}).get_bool("include_usage", False)
    return GenParams(
        sampling=_sampling(f, service, top, logprobs),
        max_tokens=_max_tokens(f, names, service.engine.n_ctx),
        stop=_stop(f),
        ignore_eos=f.get_bool("ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        grammar=grammar,
        echo=not chat and echo,
        n=n,
    )


def llama_params(
    body: dict[str, Any], service: Service, grammar: Grammar | None = None
) -> GenParams:
    """llama-server's /completion; ``grammar``: structured.py's."""
    f = Fields(body)
    _check_n(f)
    n_probs = f.get_int("n_probs", 0, lo=0, hi=MAX_N_PROBS)
    return GenParams(
        sampling=_sampling(f, service, n_probs, n_probs > 0),
        max_tokens=_max_tokens(f, ("n_predict", "max_tokens"), service.engine.n_ctx),
        stop=_stop(f),
        ignore_eos=f.get_bool("ignore_eos", False),
        stream=f.get_bool("stream", False),
        include_usage=False,
        grammar=grammar,
    )


def anthropic_params(body: dict[str, Any], service: Service) -> GenParams:
    """Anthropic's /v1/messages: ``max_tokens`` required, ``stop_sequences``, temperature in
    [0, 1]. A ``max_tokens`` past the context is cut to it: Anthropic clients send their model's
    output limit, and generation stops at the context end whatever the request says."""
    f = Fields(body)
    if not f.has("max_tokens"):
        raise ApiError("'max_tokens' is required", param="max_tokens")
    f.get_float("temperature", 0.0, lo=0.0, hi=1.0)
    if f.has("metadata") and not isinstance(body["metadata"], dict):
        raise ApiError("'metadata' must be an object", param="metadata")
    return GenParams(
        sampling=_sampling(f, service, 0, False),
        max_tokens=min(f.get_int("max_tokens", 1, lo=1), service.engine.n_ctx),
        stop=_stop(f, "stop_sequences"),
        ignore_eos=False,
        stream=f.get_bool("stream", False),
        include_usage=False,
    )


def responses_params(
    body: dict[str, Any], service: Service, grammar: Grammar | None = None
) -> GenParams:
    """OpenAI's /v1/responses: ``max_output_tokens`` and sampling; no stop strings."""
    f = Fields(body)
    return GenParams(
        sampling=_sampling(f, service, 0, False),
        max_tokens=_max_tokens(f, ("max_output_tokens",), service.engine.n_ctx),
        stop=(),
        ignore_eos=False,
        stream=f.get_bool("stream", False),
        include_usage=False,
        grammar=grammar,
    )


def engine_request(
    service: Service,
    params: GenParams,
    prompt: list[int],
    param: str = "prompt",
    reasoning: ReasoningBudget | None = None,
) -> Request:
    """The ``Request`` the engine runs, trusted there: the prompt checked against the context,
    ``max_tokens`` resolved (the request's, else --n-predict, else up to the context end);
    ``reasoning``: a chat request's (api/reasoning.py)."""
    n_ctx = service.engine.n_ctx
    if not prompt:
        raise ApiError("the prompt is empty", param=param)
    if len(prompt) >= n_ctx:
        raise ApiError(
            f"the prompt has {len(prompt)} tokens; the context holds {n_ctx} per request, "
            "and at least one token must be left to generate",
            param=param,
            code="context_length_exceeded",
        )
    room = n_ctx - len(prompt)
    n_predict = service.settings.n_predict
    return Request(
        id=uuid.uuid4().hex,
        prompt=prompt,
        sampling=params.sampling,
        max_tokens=params.max_tokens or (min(n_predict, room) if n_predict > 0 else room),
        stop_token_ids=frozenset(service.tokenizer.eog_ids),
        ignore_eos=params.ignore_eos,
        grammar=params.grammar,
        reasoning=reasoning,
    )
