"""Every ``tokenizer.ggml.pre`` name llama.cpp 0.3.36 knows, against llama.cpp itself: the gpt-2
vocabulary under each name tokenizes the test corpus plus Unicode-class stress texts to the ids
llama.cpp gave (tests/data/make_pretok_reference.py), with the same add_bos / BOS defaults and
the same detokenized text (clean_spaces). Also the pieces the pre-tokenizers are built from."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.text import unicode as uni
from mgserve.core.text.pretok import PreTokenizer
from mgserve.core.text.pretok_types import PRE_TYPES, REGEXES, PreType
from mgserve.core.text.tokenizer import Tokenizer
from tests.core.test_tokenizer_llama_vectors import metadata

DATA = Path(__file__).parent.parent / "data"


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return json.loads(gzip.decompress((DATA / "tokenizer_ref_pretok.json.gz").read_bytes()))


def test_every_llama_cpp_name_is_known(ref: dict[str, Any]) -> None:
    # "whitespace" is only meant for llama.cpp's whitespace tokenizer model (which mgserve
    # refuses); with a gpt2 vocab llama.cpp aborts on it, so it has no reference
    assert set(ref["names"]) == set(PRE_TYPES) - {"whitespace"}
    assert len(PRE_TYPES) == 91
    assert len(ref["ids"]) >= 20  # the names really tokenize differently


@pytest.mark.parametrize("vocab", ["gpt-2", "marks"])
def test_every_name_matches_llama_cpp(ref: dict[str, Any], vocab: str) -> None:
    """gpt-2's vocab, and a small BPE whose merges join letters to marks (so that qwen35 and
    qwen2, which differ only there, give different ids)."""
    if vocab == "gpt-2":
        base = metadata("gpt-2")
    else:
        base = GGUFFile(DATA / "tokenizer_bpe_marks.gguf").metadata
    built: dict[PreType, Tokenizer] = {}
    bad = []
    for name, want in sorted(ref["names"].items()):
        pre = PRE_TYPES[name]
        tok = built.get(pre)
        if tok is None:
            tok = built[pre] = Tokenizer.from_metadata({**base, "tokenizer.ggml.pre": name})
        if vocab == "gpt-2":
            assert (tok.add_bos, tok.bos_id) == (want["add_bos"], want["bos"]), name
            assert tok.decode(ref["sample_ids"]) == want["sample_text"], name
        for text, ids in zip(ref["texts"], ref["ids"][want[vocab]], strict=True):
            got = tok.encode(text, add_special=False)
            if got != ids:
                bad.append((name, text[:30], got[:8], ids[:8]))
    assert not bad, f"{len(bad)} differ; first: {bad[:3]}"
    if vocab == "marks":
        assert want_ids(ref, "qwen35", vocab) != want_ids(ref, "qwen2", vocab)


def want_ids(ref: dict[str, Any], name: str, vocab: str) -> list[list[int]]:
    return ref["ids"][ref["names"][name][vocab]]


def test_collapsed_text_follows_llama_cpp_categories() -> None:
    # U+2FFC is a symbol only since Unicode 15.1, U+0897 a mark only since 16.0: llama.cpp's
    # tables (and ours) are 15.1
    text = "a1 é\u0301\u0663!+\u00a0\u2ffc\u0897\u4e2d"
    assert uni.collapse(text) == "a1 \xd2\xd4\xd1!+\x0b\xd5\xd0\xd2"
    assert uni.collapse(text, han=True)[-1] == "\xd6"
    assert uni.wide("x\u3000y\x1c") == "x\x0by\x1c"  # \x1c is no C-locale space
    assert uni.collapse("plain ascii") == "plain ascii"


def test_pretokenizer_words() -> None:
    qwen35 = PreTokenizer(REGEXES["qwen35"])
    qwen2 = PreTokenizer(REGEXES["qwen2"])
    assert qwen35.split("re\u0301sume\u0301 x") == ["re\u0301sume\u0301", " x"]
    assert qwen2.split("re\u0301sume\u0301") == ["re", "\u0301sume", "\u0301"]
    deepseek = PreTokenizer(REGEXES["deepseek-llm"])
    assert deepseek.split("a  \n") == ["a", "  ", "\n"]
    assert deepseek.split("  1 \t") == ["  ", "1", " \t"]  # "\\s+$": the trailing whitespace
    triples = PreTokenizer(REGEXES["superbpe"])
    assert triples.split("1234567 ab12") == ["1", "234", "567", " ab", "12"]
    digits = PreTokenizer(REGEXES["afmoe"][:1])
    assert digits.split("ab1234567cd") == ["ab1", "234", "567", "cd"]
    assert PreTokenizer(REGEXES["llama3"]).split("") == []


def test_pathological_input_is_not_quadratic() -> None:
    """Long runs of one character class stay linear for every regex list (deepseek-llm's
    ``\\s+$``, superbpe's digit lookahead and jais2's whitespace cascade are quadratic searched
    naively)."""
    import time

    for key, regexes in REGEXES.items():
        pre = PreTokenizer(regexes)
        for unit in ("a", " ", "\t", "1", "\u0301", "!", "\n "):
            times = []
            for n in (10_000, 40_000):
                text = unit * (n // len(unit)) + "5"
                best = float("inf")
                for _ in range(4):  # the best of 4: a lone pause on a shared CI core is not it
                    t0 = time.perf_counter()
                    pre.split(text)
                    best = min(best, time.perf_counter() - t0)
                times.append(best)
            assert times[1] < max(0.1, 10 * times[0]), (key, unit, times)


def test_refusals_name_the_key() -> None:
    base = metadata("gpt-2")
    for model in ("t5", "rwkv", "plamo2", "hybriddna", "no_vocab"):
        with pytest.raises(ValueError, match=re.escape(f"tokenizer.ggml.model = {model!r}")):
            Tokenizer.from_metadata({**base, "tokenizer.ggml.model": model})
