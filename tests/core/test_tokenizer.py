"""The tokenizer against llama.cpp: ids, text and pieces for every corpus entry, recorded once by
tests/data/make_tokenizer_reference.py (llama-cpp-python 0.3.36) for the built-in Gemma 3 270M
(SentencePiece), the same vocab with add_space_prefix on (Llama-2 style), three tiny
byte-level BPE files (qwen2, llama-bpe, default pre-tokenizers), Qwen's 151k vocab with the
qwen35 pre-tokenizer (Qwen3.8-Flash-Next's) and SmolLM2's (smollm, the default chat model)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.text.bpe import BYTE_TO_CHAR
from mgserve.core.text.detokenizer import _safe_cut, clean_spaces
from mgserve.core.text.merge import _by_heap, _by_rank
from mgserve.core.text.spm import SPACE, SpmEncoder
from mgserve.core.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.core.test_tokenizer_llama_vectors import load_vocab, metadata

DATA = Path(__file__).parent.parent / "data"
MODELS = (
    "gemma3", "gemma3_prefix", "bpe_qwen2", "bpe_llama-bpe", "bpe_default", "qwen35", "smollm",
)  # fmt: skip
CORPUS: list[str] = json.loads((DATA / "tokenizer_corpus.json").read_text())


def _reference(name: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((DATA / f"tokenizer_ref_{name}.json.gz").read_bytes()))


@pytest.fixture(scope="session")
def gemma_meta(gemma_path: Path) -> dict[str, Any]:
    return GGUFFile(gemma_path).metadata


@pytest.fixture(scope="session")
def toks(gemma_meta: dict[str, Any]) -> dict[str, Tokenizer]:
    out = {
        "gemma3": Tokenizer.from_metadata(gemma_meta),
        "gemma3_prefix": Tokenizer.from_metadata(
            {**gemma_meta, "tokenizer.ggml.add_space_prefix": True}
        ),
    }
    for name in MODELS[2:5]:
        pre = name.removeprefix("bpe_")
        out[name] = Tokenizer.from_metadata(GGUFFile(DATA / f"tokenizer_bpe_{pre}.gguf").metadata)
    out["qwen35"] = Tokenizer.from_metadata(metadata("qwen35"))
    out["smollm"] = Tokenizer.from_metadata(load_vocab(DATA / "tokenizer_vocab_smollm.meta.json"))
    return out


@pytest.fixture(scope="session", params=MODELS)
def case(request: pytest.FixtureRequest, toks: dict[str, Tokenizer]) -> tuple[Tokenizer, dict]:
    return toks[request.param], _reference(request.param)


def test_corpus_is_varied() -> None:
    assert len(CORPUS) >= 250
    joined = "".join(CORPUS)
    needles = ["def ", "#include", '{"', "\t\t", "   ", "\n\n", "é", "日本", "한국", "مرحبا"]
    needles += ["\u0301", "\U0001f468\u200d\U0001f469", "🇯🇵", "<start_of_turn>", "<bos>"]
    needles += ["<|im_start|>", "9" * 50]
    for needle in needles:
        assert needle in joined, needle
    assert "" in CORPUS and max(map(len, CORPUS)) >= 3000


def test_encode_matches_llama_cpp(case: tuple[Tokenizer, dict]) -> None:
    tok, ref = case
    assert len(ref["entries"]) == len(CORPUS)
    bad = []
    for text, entry in zip(CORPUS, ref["entries"], strict=True):
        for key, want in entry["ids"].items():
            got = tok.encode(text, add_special=key[0] == "1", parse_special=key[1] == "1")
            if got != want:
                bad.append((key, text[:40], got[:12], want[:12]))
    assert not bad, f"{len(bad)} of {4 * len(CORPUS)} differ; first: {bad[:3]}"


def test_decode_matches_llama_cpp(case: tuple[Tokenizer, dict]) -> None:
    tok, ref = case
    for entry in ref["entries"]:
        ids = entry["ids"]["11"]
        assert tok.decode(ids) == entry["text"]
        assert tok.decode(iter(ids), skip_special=True) == entry["text_nospecial"]


def test_pieces_match_llama_cpp(case: tuple[Tokenizer, dict]) -> None:
    tok, ref = case
    assert len(ref["pieces"]) > 100
    for token, (with_special, without) in ref["pieces"].items():
        assert tok.piece(int(token)).hex() == with_special, token
        assert tok.piece(int(token), special=False).hex() == without, token


def test_vocab_facts_match_llama_cpp(case: tuple[Tokenizer, dict]) -> None:
    tok, ref = case
    assert tok.n_vocab == ref["n_vocab"]
    assert (tok.bos_id, tok.eos_id) == (ref["bos"], ref["eos"])
    assert (tok.add_bos, tok.add_eos) == (ref["add_bos"], ref["add_eos"])
    assert sorted(tok.eog_ids) == ref["eog"]
    assert [t for t in range(tok.n_vocab) if tok.is_control(t)] == ref["control"]


def test_incremental_detokenizer_matches_decode(case: tuple[Tokenizer, dict]) -> None:
    tok, ref = case
    split_chars = 0
    for entry in ref["entries"]:
        ids = entry["ids"]["11"]
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, skip_special=skip)
            chunks = [det.push(t) for t in ids]
            chunks.append(det.flush())
            assert "".join(chunks) == tok.decode(ids, skip_special=skip)
            assert not any("\ufffd" in c for c in chunks), chunks
            # a token whose bytes end inside a character must not show up on its own
            split_chars += sum(
                1 for t, c in zip(ids, chunks, strict=False) if c == "" and tok.piece(t, not skip)
            )
    assert split_chars > 0  # the corpus does split characters across byte-fallback tokens


def test_gemma_special_tokens(toks: dict[str, Tokenizer]) -> None:
    tok = toks["gemma3"]
    eot = tok.token_id("<end_of_turn>")
    assert eot is not None and eot in tok.eog_ids and tok.is_control(eot)
    assert tok.token_text(eot) == "<end_of_turn>"
    assert tok.token_id("no such token text") is None
    sot = tok.token_id("<start_of_turn>")
    ids = tok.encode("<start_of_turn>user\nHi", parse_special=True)
    assert ids[:2] == [tok.bos_id, sot]
    assert sot not in tok.encode("<start_of_turn>user\nHi")  # plain text without parse_special
    assert tok.piece(eot, special=False) == b"" and tok.piece(eot) == b"<end_of_turn>"
    assert tok.decode(ids, skip_special=True) == "user\nHi"


def test_spm_word_cut_is_exact(toks: dict[str, Tokenizer]) -> None:
    """Cutting before each ▁ (except inside tokens like ">▁</") gives the ids that merging
    over the whole fragment gives, which is what llama.cpp does."""
    enc = toks["gemma3"]._encoder
    for text in [*CORPUS[:120], "<a> </b> x>▁</y", "a>  </b"]:
        for frag in text.split("\n"):
            if not frag:
                continue
            cut: list[int] = []
            enc.encode(frag, cut)
            assert cut == enc._merge(frag.replace(" ", SPACE)), frag


def test_bad_ids_and_bad_vocab(toks: dict[str, Tokenizer], gemma_meta: dict[str, Any]) -> None:
    tok = toks["gemma3"]
    for bad in (-1, tok.n_vocab):
        with pytest.raises(ValueError, match=rf"token id {bad} out of range \[0, 262144\)"):
            tok.piece(bad)
        with pytest.raises(ValueError, match="out of range"):
            tok.decode([5, bad])
        with pytest.raises(ValueError, match="out of range"):
            IncrementalDetokenizer(tok).push(bad)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model.*'t5'"):
        Tokenizer.from_metadata({**gemma_meta, "tokenizer.ggml.model": "t5"})
    bpe = GGUFFile(DATA / "tokenizer_bpe_qwen2.gguf").metadata
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre.*'nonesuch'"):
        Tokenizer.from_metadata({**bpe, "tokenizer.ggml.pre": "nonesuch"})


def test_streaming_clean_up_cut_is_safe() -> None:
    """Where the streaming detokenizer cuts a clean_spaces vocab's bytes, cleaning the two halves
    equals cleaning the whole, whatever comes next."""
    rng = random.Random(0)
    alphabet = b" '?!.,smrevtdlx"
    cuts = 0
    for _ in range(20_000):
        head = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        p = _safe_cut(bytearray(head))
        if p == 0:
            continue
        cuts += 1
        for tail in (b"", b"?", b"'s", b"'re", b" ' x", b" ."):
            whole = head + tail
            assert clean_spaces(whole) == clean_spaces(head[:p]) + clean_spaces(whole[p:])
    assert cuts > 1000


def _both_orders(enc: Any, word: str) -> tuple[Any, Any]:
    """A long word merged rank by rank from buckets (None when refused) and from the heap."""
    if isinstance(enc, SpmEncoder):
        return enc._by_rank(word), enc._by_heap(word)
    ids = enc.symbol_ids(word)
    return _by_rank(list(ids), enc.pair), _by_heap(ids, enc.pair)


@pytest.mark.parametrize("name", ["qwen35", "smollm", "gemma3"])
def test_long_words_merge_as_llama_cpp_orders_them(name: str, toks: dict[str, Tokenizer]) -> None:
    """Words over 256 characters are merged rank by rank from buckets; that must equal the
    heap order (llama.cpp's) whenever it is used, and the heap must take over when a vocab's
    merges are not monotone."""
    enc = toks[name]._encoder
    rng = random.Random(0)
    used = 0
    for alphabet in ("abcdefghijklmnopqrstuvwxyz", "ab", "a", "xyz12", "e\u0301a", "aab"):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(300, 3000)))
        if name != "gemma3":
            word = word.encode().decode("latin-1").translate(BYTE_TO_CHAR)
        by_rank, by_heap = _both_orders(enc, word)
        if by_rank is not None:
            used += 1
            assert by_rank == by_heap, alphabet
    assert used >= 4


def test_non_monotone_merges_fall_back_to_the_heap() -> None:
    """A merge list where a created pair outranks its creator ("ab a" before "a b"): the
    bucket order would merge both "a b" pairs of "abab"; llama.cpp's heap gives "aba" + "b"."""
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "aba", "x"],
        "tokenizer.ggml.merges": ["ab a", "a b"],
    }
    tok = Tokenizer.from_metadata(meta)
    word = "ab" * 200
    enc = tok._encoder
    assert _by_rank(enc.symbol_ids(word), enc.pair) is None
    assert tok.encode(word, add_special=False)[:2] == [3, 1]


def test_long_word_time_is_near_linear(toks: dict[str, Tokenizer]) -> None:
    import time

    rng = random.Random(1)
    for name in ("qwen35", "gemma3"):
        times = []
        for n in (50_000, 200_000):
            word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=n))
            toks[name]._encoder.cache.clear()
            t0 = time.perf_counter()
            toks[name].encode(word, add_special=False)
            times.append(time.perf_counter() - t0)
        assert times[1] < 6 * times[0] + 0.2, (name, times)
