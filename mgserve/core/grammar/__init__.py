"""Structured output: grammars (JSON schemas, GBNF) compiled against the model's vocabulary, and the
per-session matchers that give the allowed-token mask of the next token (llguidance underneath).

    vocab.py     every token id's bytes, special tokens marked, as the grammar engine sees them
    compiler.py  GrammarSpec -> Grammar (validated, cached by its text); GrammarCompiler
    matcher.py   Matcher: one session's state; Isolated: a matcher whose failure is the session's
                 alone; ForcedToken; bitmask rows and how the samplers apply them
"""

from __future__ import annotations

from mgserve.core.grammar.compiler import Grammar, GrammarCompiler, GrammarError, GrammarSpec
from mgserve.core.grammar.matcher import (
    ForcedToken,
    Isolated,
    Matcher,
    TokenMask,
    apply_allowed,
    bitmask_words,
    failures,
    unpack_bitmask,
)

__all__ = [
    "ForcedToken",
    "Grammar",
    "Isolated",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "Matcher",
    "TokenMask",
    "apply_allowed",
    "bitmask_words",
    "failures",
    "unpack_bitmask",
]
