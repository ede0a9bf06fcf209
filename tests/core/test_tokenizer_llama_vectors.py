"""llama.cpp's own tokenizer test vectors (the data of its test-tokenizer-0): every vocabulary
llama.cpp 0.3.36 ships with ``.inp`` / ``.out`` files, kept by tests/data/make_llama_vocab_data.py.

For each vocab and each case we compare our ids with the shipped ``.out`` (tokenized as
test-tokenizer-0 does: add_special = parse_special = false) and with the ids llama.cpp itself
gave for all four (add_special, parse_special) combinations."""

from __future__ import annotations

import json
import lzma
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from mgserve.core.text.tokenizer import Tokenizer
from tests.data.make_llama_vocab_data import EXTRA, VOCABS, split_cases, unpack_arrays

DATA = Path(__file__).parent.parent / "data" / "llama_vocab"


def load_vocab(meta_json: Path) -> dict[str, Any]:
    """Tokenizer metadata kept by tests/data/make_llama_vocab_data.py (scalars + arrays file)."""
    info = json.loads(meta_json.read_text())
    arrays = unpack_arrays(lzma.decompress((meta_json.parent / info["arrays"]).read_bytes()))
    return {**info["metadata"], **arrays}


@cache
def metadata(name: str) -> dict[str, Any]:
    return load_vocab(DATA / f"{name}.meta.json")


def cases(name: str) -> tuple[list[str], list[list[int]]]:
    texts = split_cases((DATA / f"{name}.inp").read_bytes().decode())
    lines = (DATA / f"{name}.out").read_bytes().decode().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # std::getline gives no line after the final newline
    want = [[int(t) for t in line.split()] for line in lines]
    assert len(texts) == len(want), name
    return texts, want


def test_all_shipped_vocabs_are_kept() -> None:
    kept = {p.name.removesuffix(".meta.json") for p in DATA.glob("*.meta.json")}
    assert kept == set(VOCABS)
    total = sum(p.stat().st_size for p in DATA.iterdir())
    assert total < 12_000_000, total  # the repository travels; keep the vectors small


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    return request.param, Tokenizer.from_metadata(metadata(request.param))


def test_shipped_vectors(vocab: tuple[str, Tokenizer]) -> None:
    name, tok = vocab
    texts, want = cases(name)
    assert len(texts) >= 40
    bad = [
        (text[:30], got[:10], ids[:10])
        for text, ids in zip(texts, want, strict=True)
        if (got := tok.encode(text, add_special=False, parse_special=False)) != ids
    ]
    assert not bad, f"{name}: {len(bad)} of {len(texts)} cases differ; first: {bad[:3]}"


def test_llama_cpp_ids(vocab: tuple[str, Tokenizer]) -> None:
    """Against llama.cpp itself, with and without add_special / parse_special, on the vectors
    and on texts full of special-token texts (make_llama_vocab_data.EXTRA)."""
    name, tok = vocab
    ref = json.loads((DATA / f"{name}.llama.json").read_text())
    texts = cases(name)[0] + EXTRA
    assert set(ref) == {"00", "01", "10", "11", "text0", "text1"}
    bad = []
    for key in ("00", "01", "10", "11"):
        per_case = ref[key]
        for text, ids in zip(texts, per_case, strict=True):
            got = tok.encode(text, add_special=key[0] == "1", parse_special=key[1] == "1")
            if got != ids:
                bad.append((key, text[:30], got[:10], ids[:10]))
    assert not bad, f"{name}: {len(bad)} of {4 * len(texts)} differ; first: {bad[:3]}"


def test_llama_cpp_text(vocab: tuple[str, Tokenizer]) -> None:
    """Detokenizing llama.cpp's (add_special, parse_special) ids gives llama.cpp's text."""
    name, tok = vocab
    ref = json.loads((DATA / f"{name}.llama.json").read_text())
    for ids, with_special, without in zip(ref["11"], ref["text1"], ref["text0"], strict=True):
        assert tok.decode(ids) == with_special, (name, ids[:10])
        assert tok.decode(ids, skip_special=True) == without, (name, ids[:10])
