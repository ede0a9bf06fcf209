"""Prompts as text, token ids, or llama-server's mix of both -> checked token ids."""

from __future__ import annotations

from typing import Any

from mgserve.api.errors import ApiError
from mgserve.api.service import Service


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ids(ids: list[int], n_vocab: int, param: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t < n_vocab:
            raise ApiError(
                f"{param}[{i}]: token id {t} is outside the vocabulary (0..{n_vocab - 1})",
                param=param,
            )
    return ids


def encode_text(service: Service, text: str, add_special: bool = True) -> list[int]:
    # special-token text in a prompt is parsed, as llama-server does for completions and chat
    return service.tokenizer.encode(text, add_special=add_special, parse_special=True)


def mixed_prompt(service: Service, items: list[Any], param: str) -> list[int]:
    """llama-server's [id, "text", id, ...]: text tokenized, BOS only before a leading text."""
    ids: list[int] = []
    for i, item in enumerate(items):
        if _is_id(item):
            ids.append(item)
        elif isinstance(item, str):
            ids.extend(encode_text(service, item, add_special=(i == 0)))
        else:
            raise ApiError(f"{param}[{i}] must be a token id or a string", param=param)
    return check_ids(ids, service.n_vocab, param)


def openai_prompt(service: Service, raw: Any) -> list[int]:
    """/v1/completions: str | list[int] | a one-element list of either (one prompt per call)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        return encode_text(service, raw)
    if isinstance(raw, list) and all(_is_id(t) for t in raw):
        return check_ids(list(raw), service.n_vocab, "prompt")
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, str | list) for p in raw):
        raise ApiError("only one prompt per request is supported", param="prompt")
    raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")


def llama_prompt(service: Service, raw: Any) -> list[int]:
    """/completion: str | list[int | str]."""
    if isinstance(raw, str):
        return encode_text(service, raw)
    if isinstance(raw, list):
        if len(raw) == 1 and isinstance(raw[0], list):
            raw = raw[0]
        return mixed_prompt(service, raw, "prompt")
    raise ApiError("'prompt' must be a string or a list of token ids and strings", param="prompt")


def check_prompt_length(prompt: list[int], n_ctx: int, param: str = "prompt") -> None:
    if not prompt:
        raise ApiError("the prompt is empty", param=param)
    if len(prompt) >= n_ctx:
        raise ApiError(
            f"the prompt has {len(prompt)} tokens; the context holds {n_ctx} per request, "
            "and at least one token must be left to generate",
            param=param,
            code="context_length_exceeded",
        )
