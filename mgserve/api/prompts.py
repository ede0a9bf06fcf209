"""Prompts as text, token ids, or llama-server's mix of both -> checked token ids.

These run on the service's text pool (textwork.py), not on the event loop. Before any text is
tokenized its size is checked against the most the context can hold: a token covers at most
``service.max_token_bytes`` bytes of text, so a prompt of more than ``n_ctx`` times that many
bytes has more than ``n_ctx`` tokens, and is refused at once rather than after tokenizing it.
"""

from __future__ import annotations

from typing import Any

from mgserve.api.chat_inputs import ChatInputs
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


def check_text_size(service: Service, text: str, param: str = "prompt") -> None:
    """400 (context_length_exceeded) for a text too long to fit the context in any tokenization."""
    limit = service.engine.n_ctx * service.max_token_bytes
    if len(text) <= limit // 4:  # at most 4 bytes a character: no need to count them
        return
    n_bytes = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if n_bytes > limit:
        raise ApiError(
            f"the prompt is {'at least ' if len(text) > limit else ''}{n_bytes} bytes, more than "
            f"the context's {service.engine.n_ctx} tokens can hold (a token covers at most "
            f"{service.max_token_bytes} bytes)",
            param=param,
            code="context_length_exceeded",
        )


def encode_text(
    service: Service,
    text: str,
    add_special: bool = True,
    param: str = "prompt",
    parse_special: bool = True,
) -> list[int]:
    check_text_size(service, text, param)
    # special-token text in a prompt is parsed, as llama-server does for completions and chat
    return service.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)


def mixed_prompt(
    service: Service,
    items: list[Any],
    param: str,
    limit: bool = True,
    add_special: bool = True,
    parse_special: bool = True,
) -> list[int]:
    """llama-server's [id, "text", id, ...]: text tokenized, BOS (with ``add_special``) only before
    a leading text. ``limit=False`` (/tokenize) tokenizes texts of any size the body limit lets
    through."""
    if limit:
        check_text_size(service, "".join(s for s in items if isinstance(s, str)), param)
    ids: list[int] = []
    for i, item in enumerate(items):
        if _is_id(item):
            ids.append(item)
        elif isinstance(item, str):
            ids.extend(
                service.tokenizer.encode(
                    item, add_special=add_special and i == 0, parse_special=parse_special
                )
            )
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


def echo_text(service: Service, raw: Any, ids: list[int]) -> str:
    """What ``echo`` puts before a /v1/completions answer: the prompt as the client sent it
    (its text, or its token ids' text)."""
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    return b"".join(service.tokenizer.piece(t) for t in ids).decode("utf-8", errors="replace")


def llama_prompt(service: Service, raw: Any) -> list[int]:
    """/completion: str | list[int | str]."""
    if isinstance(raw, str):
        return encode_text(service, raw)
    if isinstance(raw, list):
        if len(raw) == 1 and isinstance(raw[0], list):
            raw = raw[0]
        return mixed_prompt(service, raw, "prompt")
    raise ApiError("'prompt' must be a string or a list of token ids and strings", param="prompt")


def render_chat(service: Service, inputs: ChatInputs) -> str:
    """The chat template applied; its refusals (and bad messages) are 400s."""
    try:
        return service.chat.apply(
            inputs.messages, inputs.add_generation_prompt, inputs.tools, inputs.kwargs
        )
    except ValueError as e:
        msg = str(e)
        param = next(
            (p for p in ("tools", "chat_template_kwargs") if msg.lstrip("'").startswith(p)),
            "messages",
        )
        raise ApiError(msg, param=param) from None
