"""Grammars from their text: JSON schemas, GBNF and Lark, validated and compiled once per text.

``GrammarCompiler.compile(spec)`` checks a grammar against the vocabulary and returns a
``Grammar``, shared (and cached, by kind and text) by every request that asks for the same one;
each session then gets a ``Matcher`` from it. A bad grammar raises ``GrammarError`` with
llguidance's message, for the API's 400.

JSON is generated in one fixed layout, ``{"a": 1, "b": [2, 3]}`` (", " and ": ", no other
whitespace): a small model sampling freely cannot wander into whitespace, and the text is what
``json.dumps`` writes. A schema's own ``x-guidance`` options (llguidance's) override this; a
Lark grammar's embedded ``%json`` schemas carry these options themselves.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import llguidance
import orjson

from mgserve.core.grammar.matcher import Matcher
from mgserve.core.grammar.vocab import ll_tokenizer
from mgserve.core.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
CACHE_SIZE = 64  # compiled grammars kept (least recently used dropped first)


class GrammarError(ValueError):
    """The grammar or schema is invalid (the message says where)."""


class GrammarSpec(NamedTuple):
    kind: Literal["json_schema", "gbnf", "lark"]
    # the schema as JSON text, the GBNF (llama.cpp's grammar format) source, or a grammar in
    # llguidance's Lark syntax (the server's own: forced tool calls)
    text: str

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        """From a schema object (a dict, or True for any JSON value); key order is kept."""
        return cls("json_schema", orjson.dumps(schema).decode())


class Grammar:
    """A grammar checked against one vocabulary; ``matcher()`` starts a session in it."""

    def __init__(self, spec: GrammarSpec, start: llguidance.LLMatcher, n_vocab: int) -> None:
        self.spec = spec
        self.n_vocab = n_vocab
        self._start = start  # never advanced: every session starts from a copy

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self.n_vocab)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
        return llguidance.grammar_from(spec.kind, spec.text)
    except ValueError as e:
        raise GrammarError(str(e)) from None


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary (``n_vocab``: its logits' width); thread-safe.

    llguidance's view of the vocabulary takes about a second to build, so it is built on the
    first grammar, not at start-up; ``compile_async`` keeps that and every compile off the loop."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self.tokenizer, self.n_vocab)
            return self._ll

    def compile(self, spec: GrammarSpec) -> Grammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        start = llguidance.LLMatcher(self.ll_tokenizer(), _llguidance_grammar(spec), log_level=0)
        if start.is_error():
            raise GrammarError(start.get_error())
        grammar = Grammar(spec, start, self.n_vocab)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def json_schema(self, schema: Any) -> Grammar:
        """The grammar of JSON text valid under ``schema`` (e.g. a tool call's arguments)."""
        return self.compile(GrammarSpec.json_schema(schema))

    async def compile_async(self, spec: GrammarSpec) -> Grammar:
        return await asyncio.get_running_loop().run_in_executor(None, self.compile, spec)
