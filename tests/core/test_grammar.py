"""Grammars and matchers (mgserve/core/grammar/) on a small byte-level vocabulary, and the CPU
sampler under a grammar.

The vocabulary is a synthetic BPE one of 320 tokens (256 bytes, a few merges, fillers, three
control tokens), small enough to check every token of every mask against a brute-force answer.
"""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import jsonschema
import pytest
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.engine.sampling import SeqSampler
from mgserve.core.grammar import (
    Grammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    apply_allowed,
    bitmask_words,
    unpack_bitmask,
)
from mgserve.core.grammar.vocab import SPECIAL_PREFIX, token_bytes
from mgserve.core.synth.vocab import SynthVocab
from mgserve.core.text.tokenizer import Tokenizer

VOCAB = SynthVocab(320, "qwen2", endoftext_id=317, im_start_id=318, im_end_id=319)
N_VOCAB = 328  # the logits are wider than the tokenizer (a padded embedding)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "maxLength": 4},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["answer", "count", "tag"],
    "additionalProperties": False,
}


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata({k: v for k, (v, _) in VOCAB.metadata().items()})


@cache
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tokenizer(), N_VOCAB)


def allowed_ids(m: Any) -> set[int]:
    return set(m.allowed().tolist())


def test_token_bytes_set_special_tokens_apart_and_pad_the_vocabulary() -> None:
    tb = token_bytes(tokenizer(), N_VOCAB)
    assert len(tb) == N_VOCAB and tb[ord("a")] == b"a" and tb[-1] == b""
    assert tb[VOCAB.im_end_id] == SPECIAL_PREFIX + b"<|im_end|>"
    assert tb[300] == b"<unused_300>"  # a filler is text (no text produces it, but it is bytes)


def test_unpack_bitmask_and_apply_allowed() -> None:
    v = 70
    bits = torch.zeros(2, bitmask_words(v), dtype=torch.int32)
    bits[0, 0] = 1 << 3
    bits[0, 2] = 1 << 5  # token 69
    bits[1, 0] = -(2**31)  # bit 31 only: the sign bit
    allowed = unpack_bitmask(bits, v)
    assert allowed.shape == (2, v)
    assert allowed[0].nonzero().flatten().tolist() == [3, 69]
    assert allowed[1].nonzero().flatten().tolist() == [31]
    raw = torch.randn(2, v)
    x = raw.clone()
    x[1, 31] = -torch.inf  # a bias banned the one allowed token: the raw logits win
    out = apply_allowed(x, raw, allowed)
    assert torch.equal(out[0, [3, 69]], raw[0, [3, 69]]) and torch.isneginf(out[0]).sum() == v - 2
    assert out[1, 31] == raw[1, 31] and torch.isneginf(out[1]).sum() == v - 1


WORDS = ("yes", "no", "inn", "there")


def test_gbnf_masks_allow_exactly_the_valid_continuations() -> None:
    """Every token whose text continues a word; once one word is left (its rest forced), the first
    token of that rest as the tokenizer cuts it (llguidance keeps forced text canonical); the
    end-of-generation ids exactly when a word is complete."""
    tok = tokenizer()
    g = compiler().compile(GrammarSpec("gbnf", "root ::= " + " | ".join(f'"{w}"' for w in WORDS)))
    eog = set(tok.eog_ids)
    pieces = {tok.piece(t) for t in range(tok.n_vocab) if t not in eog} - {b""}
    rng = random.Random(0)
    for _ in range(30):
        m, text = g.matcher(), b""
        while True:
            left = [w.encode() for w in WORDS if w.encode().startswith(text) and w != text.decode()]
            if len(left) == 1 and text:
                want = {tok.piece(tok.encode(left[0][len(text) :].decode(), add_special=False)[0])}
            else:
                want = {p for p in pieces if any(w.startswith(text + p) for w in left)}
            got = allowed_ids(m)
            assert {tok.piece(t) for t in got - eog} == want, text
            assert bool(got & eog) == (text.decode() in WORDS), text
            if not want:
                assert m.done
                break
            t = rng.choice(sorted(got - eog))
            m.advance(t)
            text += tok.piece(t)
        assert text.decode() in WORDS


def test_json_schema_walks_end_valid_and_eos_only_when_complete() -> None:
    tok = tokenizer()
    g = compiler().json_schema(SCHEMA)
    eog = set(tok.eog_ids)
    rng = random.Random(1)
    for _ in range(40):
        m, text = g.matcher(), b""
        for _step in range(200):
            got = allowed_ids(m)
            assert got, text
            complete = _valid(text)
            assert bool(got & eog) == complete, text
            if got <= eog:
                break
            t = rng.choice(sorted(got - eog))
            m.advance(t)
            text += tok.piece(t)
        else:
            pytest.fail(f"no end after 200 tokens: {text!r}")
        doc = json.loads(text)
        jsonschema.validate(doc, SCHEMA)
        assert text.decode() == json.dumps(doc, ensure_ascii=False)  # the one layout


def _valid(text: bytes) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_compile_is_cached_by_text_and_bad_grammars_raise() -> None:
    c = compiler()
    assert c.json_schema({"type": "object"}) is c.json_schema({"type": "object"})
    assert isinstance(c.compile(GrammarSpec("gbnf", 'root ::= "a"')), Grammar)
    for spec in (
        GrammarSpec("json_schema", '{"type": 5}'),
        GrammarSpec("json_schema", "not json"),
        GrammarSpec("json_schema", '{"$ref": "#/nowhere"}'),
        GrammarSpec("gbnf", "root ::= undefined"),
        GrammarSpec("gbnf", "root ::= ("),
    ):
        with pytest.raises(GrammarError):
            c.compile(spec)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=4),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.5, repeat_penalty=1.3, seed=5),
    ],
)
def test_seq_sampler_under_a_grammar_gives_valid_json(params: SamplingParams) -> None:
    tok = tokenizer()
    gen = torch.Generator().manual_seed(0)
    s = SeqSampler(params, grammar=compiler().json_schema(SCHEMA))
    out: list[int] = []
    for _ in range(200):
        t = s.sample(torch.randn(N_VOCAB, generator=gen) * 3)  # [V]
        if t in tok.eog_ids:
            break
        out.append(t)
    jsonschema.validate(json.loads(b"".join(tok.piece(t) for t in out)), SCHEMA)


def test_a_bias_that_bans_every_allowed_token_loses_to_the_grammar() -> None:
    ban = tuple((t, -torch.inf) for t in range(N_VOCAB) if t != ord("{"))
    g = compiler().compile(GrammarSpec("gbnf", 'root ::= "ab"'))
    s = SeqSampler(SamplingParams(temperature=0.0, logit_bias=ban), grammar=g)
    assert s.sample(torch.zeros(N_VOCAB)) == ord("a")
