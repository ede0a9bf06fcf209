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

import numpy as np
import pytest

from mgserve.core.tokenizer import Tokenizer

DATA = Path(__file__).parent.parent / "data" / "llama_vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
VOCABS = (
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip


EXTRA = [
    "<s> hi </s>  x <unk>\n", "<|endoftext|>\n  a<|endoftext|>", "<|assistant|>  \n hi <|end|> ",
    "[CLS] a [SEP] [MASK]  b [UNK]", "<mask>  b <pad>", "<start_of_turn>user\n hi<end_of_turn>",
    "<|im_start|>  x<|im_end|>\n", "<bos><eos>  <|begin_of_text|> <|eot_id|>",
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|> x", "<｜begin▁of▁sentence｜>  y", "\t<s>\t</s>\t",
]  # fmt: skip  # the same as tests/data/make_llama_vocab_data.py's


def split_cases(raw: str) -> list[str]:
    """test-tokenizer-0.cpp's read_tests: cases between separators, none after a final one."""
    out: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt == -1:
            out.append(raw[pos:])
            break
        out.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    return out


def _unpack(raw: bytes) -> dict[str, Any]:
    """tests/data/make_llama_vocab_data.py's container: JSON header line, then the arrays."""
    line, _, body = raw.partition(b"\n")
    out: dict[str, Any] = {}
    for key, (kind, offset, size, count) in json.loads(line).items():
        blob = body[offset : offset + size]
        if kind == "str":
            lengths = np.frombuffer(blob[: 4 * count], dtype="<u4").tolist()
            text = blob[4 * count :]
            strings, pos = [], 0
            for n in lengths:
                strings.append(text[pos : pos + n].decode())
                pos += n
            out[key] = strings
        else:
            out[key] = np.frombuffer(blob, dtype=kind)
    return out


def load_vocab(meta_json: Path) -> dict[str, Any]:
    """Tokenizer metadata kept by tests/data/make_llama_vocab_data.py (scalars + arrays file)."""
    info = json.loads(meta_json.read_text())
    arrays = _unpack(lzma.decompress((meta_json.parent / info["arrays"]).read_bytes()))
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
