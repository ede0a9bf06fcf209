"""Cut hints for a chat prompt: token positions where its leading messages end.

A recurrent (Gated DeltaNet) model reuses another request's prefix only from a checkpoint, taken
where a prompt chunk ends (core/engine/checkpoints.py). Chunks also end at a request's hints, so a
shared system prompt or the conversation before the last user turn gets a checkpoint of its own.

Two boundaries at most: after the leading system (developer) messages, and before the last user
message. The template is rendered for the messages before the boundary plus a probe user message
(so a template that refuses a conversation without a user query, or places reasoning by the last
one, renders the prefix as it does inside the whole conversation); the boundary is where that text
and the prompt's text part. It is kept only where the prompt's tokens split there: the text up to
each boundary, tokenized piece by piece from the previous one, gives the prompt's first tokens,
so a hint is never inside a token and two prompts sharing the messages get the same hints.
Hints under ``MIN_HINT`` tokens are dropped. Raw prompts (/completion, /v1/completions) have none.
"""

from __future__ import annotations

import os
from typing import Any

from mgserve.api.chat_inputs import ChatInputs
from mgserve.api.service import Service

MIN_HINT = 64  # a shorter shared prefix is not worth a chunk cut and a checkpoint
_PROBE = {"role": "user", "content": "\x00"}  # no real message's text starts so


def _role(m: Any) -> Any:
    return m.get("role") if isinstance(m, dict) else None


def boundaries(messages: list[Any]) -> list[int]:
    """Message counts to cut after: the leading system block, the turns before the last user
    message (ascending, each inside the conversation)."""
    n_sys = 0
    while n_sys < len(messages) and _role(messages[n_sys]) in ("system", "developer"):
        n_sys += 1
    users = [i for i, m in enumerate(messages) if _role(m) == "user"]
    ks = {n_sys, users[-1] if users else 0}
    return sorted(k for k in ks if 0 < k < len(messages))


def message_cuts(
    service: Service, inputs: ChatInputs, text: str, ids: list[int]
) -> tuple[int, ...]:
    """The hints of prompt ``ids``, tokenized from ``text`` (the rendered ``inputs``, maybe with
    a prefill after it); none where the engine takes no checkpoints."""
    messages = inputs.messages
    if not service.engine.cut_hints or not isinstance(messages, list):
        return ()
    offsets = []
    for k in boundaries(messages):
        try:
            probe = service.chat.apply(messages[:k] + [_PROBE], False, inputs.tools, inputs.kwargs)
        except ValueError:
            continue
        offsets.append(len(os.path.commonprefix([probe, text])))
    hints: list[int] = []
    done, n = 0, 0  # characters and tokens split off so far
    for off in sorted(set(offsets)):
        if off <= done:
            continue
        piece = service.tokenizer.encode(text[done:off], add_special=done == 0, parse_special=True)
        if ids[n : n + len(piece)] != piece:
            break  # the prompt's tokens do not split here: no hint from here on
        done, n = off, n + len(piece)
        if MIN_HINT <= n < len(ids):
            hints.append(n)
    return tuple(hints)
