"""Request bodies -> typed generation parameters -> the ``Request`` the engine runs.

Every field is type- and range-checked here (the sampling fields in ``sampling_fields.py``), once,
and every default resolved here (the seed, ``max_tokens``, the sampling stages, llama-server's
``id_slot`` / ``cache_prompt`` / ``return_progress``, ``speculative*``): anything wrong raises
``ApiError`` (HTTP 400, OpenAI's error shape, ``param`` naming the field), so handlers never see an
unchecked value
and the engine checks nothing again. Every dialect lands on one ``GenParams``: OpenAI's names
(``max_tokens``, ``logprobs``/``top_logprobs``, the Responses API's ``max_output_tokens``),
llama-server's (``n_predict``, ``n_probs``) and Anthropic's (``stop_sequences``); the grammar
fields are read by ``structured.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields
from mgserve.api.sampling_fields import sampling_params
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
    # llama-server's admission fields: id_slot (None: any slot), cache_prompt, return_progress
    slot: int | None = None
    reuse_prefix: bool = True
    progress: bool = False
    # n-gram speculation: "speculative", "speculative.n_max" (None: --spec-k), "speculative.n_min"
    speculative: bool = True
    draft_max: int | None = None
    draft_min: int = 0


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


def _admission(f: Fields, n_slots: int, stream: bool, n: int = 1) -> dict[str, Any]:
    """llama-server's ``id_slot``, ``cache_prompt`` and ``return_progress``, as GenParams fields."""
    slot = f.get_int("id_slot", -1, lo=-1, hi=n_slots - 1)
    if slot >= 0 and n > 1:
        raise ApiError("'id_slot' pins one slot; it cannot serve n > 1 choices", param="id_slot")
    progress = f.get_bool("return_progress", False)
    if progress and not stream:
        raise ApiError(
            "'return_progress' streams prompt progress: it needs 'stream': true",
            param="return_progress",
        )
    return {
        "slot": None if slot < 0 else slot,
        "reuse_prefix": f.get_bool("cache_prompt", True),
        "progress": progress,
    }


def _speculation(f: Fields, spec_k: int) -> dict[str, Any]:
    """``speculative`` and llama-server's ``speculative.n_max`` / ``n_min``, as GenParams
    fields; a step never carries more drafts than the server's --spec-k."""
    n_max = f.get_int("speculative.n_max", spec_k, lo=0)
    if n_max > spec_k:
        raise ApiError(
            f"'speculative.n_max' must be at most {spec_k} (the server's --spec-k), got {n_max}",
            param="speculative.n_max",
        )
    n_min = f.get_int("speculative.n_min", 0, lo=0)
    if n_min > n_max:
        raise ApiError(
            f"'speculative.n_min' must be at most speculative.n_max ({n_max}), got {n_min}",
            param="speculative.n_min",
        )
    return {
        "speculative": f.get_bool("speculative", True),
        "draft_max": n_max if f.has("speculative.n_max") else None,
        "draft_min": n_min,
    }


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
        sampling=sampling_params(f, service, top, logprobs),
        max_tokens=_max_tokens(f, names, service.engine.n_ctx),
        stop=_stop(f),
        ignore_eos=f.get_bool("ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        grammar=grammar,
        echo=not chat and echo,
        n=n,
        **_admission(f, service.engine.n_slots, stream, n),
        **_speculation(f, service.settings.spec_k),
    )


def llama_params(
    body: dict[str, Any], service: Service, grammar: Grammar | None = None
) -> GenParams:
    """llama-server's /completion; ``grammar``: structured.py's."""
    f = Fields(body)
    _check_n(f)
    n_probs = f.get_int("n_probs", 0, lo=0, hi=MAX_N_PROBS)
    stream = f.get_bool("stream", False)
    return GenParams(
        sampling=sampling_params(f, service, n_probs, n_probs > 0),
        max_tokens=_max_tokens(f, ("n_predict", "max_tokens"), service.engine.n_ctx),
        stop=_stop(f),
        ignore_eos=f.get_bool("ignore_eos", False),
        stream=stream,
        include_usage=False,
        grammar=grammar,
        **_admission(f, service.engine.n_slots, stream),
        **_speculation(f, service.settings.spec_k),
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
        sampling=sampling_params(f, service, 0, False),
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
        sampling=sampling_params(f, service, 0, False),
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
    cut_hints: tuple[int, ...] = (),
) -> Request:
    """The ``Request`` the engine runs, trusted there: the prompt checked against the context,
    ``max_tokens`` resolved (the request's, else --n-predict, else up to the context end);
    ``reasoning`` and ``cut_hints``: a chat request's (api/reasoning.py, api/message_cuts.py)."""
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
        slot=params.slot,
        reuse_prefix=params.reuse_prefix,
        progress=params.progress,
        cut_hints=cut_hints,
        speculative=params.speculative,
        draft_max=params.draft_max,
        draft_min=params.draft_min,
    )
