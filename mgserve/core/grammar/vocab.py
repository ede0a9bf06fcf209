"""The vocabulary as a grammar engine sees it: each token id's bytes, special tokens set apart.

A grammar constrains bytes, so the engine needs every token's exact bytes (``Tokenizer.piece``:
byte tokens are their one byte, SentencePiece's "▁" a space). Control tokens, and user-defined
ones written like ``<start_of_image>``, are not text: llguidance takes them with a leading 0xFF
byte (which no UTF-8 text contains), so no grammar ever allows them, except the end-of-generation
ids, which it allows once the grammar is complete. This is llguidance's own convention for
llama.cpp vocabularies (``llguidance/llamacpp.py``).
"""

from __future__ import annotations

import llguidance

from mgserve.core.text.special import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED
from mgserve.core.text.tokenizer import Tokenizer

SPECIAL_PREFIX = b"\xff"


def is_special(tok: Tokenizer, token: int) -> bool:
    """A token that is not text: control, unknown, or user-defined and written ``<...>``."""
    attr = tok.attr(token)
    if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
        return True
    text = tok.token_text(token)
    return bool(attr & ATTR_USER_DEFINED) and text.startswith("<") and text.endswith(">")


def token_bytes(tok: Tokenizer, n_vocab: int) -> list[bytes]:
    """Per id in [0, n_vocab): the token's bytes, SPECIAL_PREFIX + its text for a special token,
    and b"" for ids past the tokenizer's vocabulary (a padded embedding) and unused ids."""
    out: list[bytes] = []
    for t in range(tok.n_vocab):
        piece = tok.piece(t)
        out.append(SPECIAL_PREFIX + piece if is_special(tok, t) else piece)
    out.extend(b"" for _ in range(n_vocab - tok.n_vocab))
    return out


class _Wrapped:
    """What ``llguidance.TokenizerWrapper`` reads: ids, token bytes and a tokenize function."""

    def __init__(self, tok: Tokenizer, tokens: list[bytes], eos: int) -> None:
        self.tok = tok
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = tok.bos_id

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special=False)


def ll_tokenizer(tok: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tok``, logits ``n_vocab`` wide; every end-of-generation id ends a
    complete grammar. Takes about a second for a 262k vocabulary: build it once."""
    eog = sorted(tok.eog_ids)
    if not eog:
        raise ValueError("the vocabulary has no end-of-generation token to end a grammar with")
    wrapped = _Wrapped(tok, token_bytes(tok, n_vocab), eog[0])
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(wrapped), n_vocab=n_vocab, eos_token=eog
    )
