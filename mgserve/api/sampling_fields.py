"""The sampling fields every dialect shares -> ``SamplingParams``: temperature and the other
stages, penalties, the seed (--seed when the request has none) and ``logit_bias`` in OpenAI's and
llama-server's forms. Checked once here, as ``protocol.py`` checks the rest."""

from __future__ import annotations

import math

from mgserve.api.errors import ApiError
from mgserve.api.fields import Fields, is_number
from mgserve.api.prompts import encode_text
from mgserve.api.service import Service
from mgserve.core.engine.contract import SamplingParams

SEED_MAX = 2**64 - 1
# bounds that keep the sampler's arithmetic finite: a logit divided by a temperature or a
# repetition penalty under 1e-6, or moved by a bias over 1e9, could overflow (inf, then NaN
# probabilities in the step that every batched request shares)
TINY = 1e-6
BIAS_MAX = 1e9
PENALTY_MAX = 1e6


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
    if len(items) > n_vocab:  # more than one per token: refused before any is read
        raise ApiError(
            f"'logit_bias' has {len(items)} entries; at most {n_vocab} (one a token) are allowed",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    for key, bias in items:
        if bias is False:
            value = -math.inf
        elif is_number(bias) and abs(bias) <= BIAS_MAX:
            value = float(bias)
        else:
            raise ApiError(
                f"logit_bias for {key!r} must be false or a number within ±{BIAS_MAX:g}",
                param="logit_bias",
            )
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
    if sum(v == -math.inf for v in out.values()) == n_vocab:
        raise ApiError("logit_bias bans every token of the vocabulary", param="logit_bias")
    return tuple(sorted(out.items()))


def sampling_params(f: Fields, service: Service, n_probs: int, logprobs: bool) -> SamplingParams:
    """The sampling fields every dialect shares (the ranges OpenAI and llama-server accept);
    ``n_probs`` and ``logprobs`` are what the route read for its logprobs fields."""
    d = SamplingParams()
    # a negative seed: random; above 2**64 - 1 no generator takes it (torch's is 64-bit)
    seed = f.get_int("seed", -1, hi=SEED_MAX)
    if seed < 0:
        seed = service.settings.seed  # --seed, the server's default (-1: random per request)
    top_p = f.get_float("top_p", d.top_p)
    if not 0.0 < top_p <= 1.0:
        raise ApiError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    temperature = f.get_float("temperature", d.temperature, lo=0.0)
    if 0.0 < temperature < TINY:
        raise ApiError(
            f"'temperature' must be 0 (greedy) or at least {TINY:g}, got {temperature}",
            param="temperature",
        )
    return SamplingParams(
        temperature=temperature,
        top_k=f.get_int("top_k", d.top_k, lo=0),
        top_p=top_p,
        min_p=f.get_float("min_p", d.min_p, lo=0.0, hi=1.0),
        repeat_penalty=f.get_float("repeat_penalty", d.repeat_penalty, lo=TINY, hi=PENALTY_MAX),
        # a window longer than the context is the whole context (as -1 says)
        repeat_last_n=min(
            f.get_int("repeat_last_n", d.repeat_last_n, lo=-1), service.settings.ctx_size
        ),
        presence_penalty=f.get_float("presence_penalty", d.presence_penalty, lo=-2.0, hi=2.0),
        frequency_penalty=f.get_float("frequency_penalty", d.frequency_penalty, lo=-2.0, hi=2.0),
        seed=None if seed < 0 else seed,
        logit_bias=_logit_bias(f, service),
        n_probs=n_probs,
        want_logprob=logprobs,
    )
