"""llama.cpp's answers for every ``tokenizer.ggml.pre`` name (run once; needs llama-cpp-python
and tests/data/llama_vocab from make_llama_vocab_data.py).

Only a handful of pre-tokenizers ship test vectors, so this writes a vocabulary once per
pre-tokenizer name llama.cpp 0.3.36 knows (a vocab-only GGUF in a temporary directory) and
records, for the test corpus plus texts that stress the Unicode classes the regexes use, with
two vocabularies: gpt-2's, and tests/data/tokenizer_bpe_marks.gguf, a small BPE trained here
without any pre-split, so that its merges join letters to their combining marks, digits to
letters and so on (real vocabs trained with one pre-tokenizer rarely tell it from another: the
qwen2 vocab gives the same ids under qwen2 and qwen35):
- the ids of each text (add_special = parse_special = false) under each name (names that give
  identical ids share one list),
- per name: add_bos, the BOS id and the text of a fixed id sequence (clean_spaces shows there).
Written to tests/data/tokenizer_ref_pretok.json.gz.

    python tests/data/make_pretok_reference.py
"""

from __future__ import annotations

import ctypes
import gzip
import json
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))

# texts where the pre-tokenizers disagree: marks, numbers of other scripts, case runs, Han and
# kana, Unicode 15.1 code points Python's own tables do not know, C-locale whitespace edges
EXTRA = [
    "e\u0301te\u0301 re\u0301sume\u0301 \u0915\u093f\u0924\u093e\u092c \u0e01\u0e34\u0e19",
    "\u0663\u0664\u0665 \uff11\uff12\uff13\uff14 \u2460\u2461 \u00bd 1234567 12345678 x9y88z777",
    "HelloWorld HTTPServer iPhone McDonald's DON'T we'RE they'Ve I'M ABC'll",
    "\u4e2d\u6587\u5b57\u7b26 \u3072\u3089\u304c\u306a \u30ab\u30bf\u30ab\u30ca",
    "\ud55c\uad6d\uc5b4 \u3131\u314f",
    "new \u2ffc\u2ffd\u31ef \U00010efd\U00011f00 \u0cf3 \U0001f6dc \u088f\u0897",
    "a\x1cb\x1dc\x1e d\x1f e\x85f\xa0g\u2028h\u3000i\u200bj\ufeffk",
    "   \n\n  \t\r\n x  \r  y\n", "$100+200=300 ^_^ ~tilde~ |pipe| `tick` <tag>",
    "\u00ab\u00bb\u2018quoted\u2019 \u201cmore\u201d \u2026\u3002\uff0c\u3001 \u0964\u06d4\u060c",
    "<sentinel:12> IMGIMGABCZ \t\n    indented", "\uff01\uff1f\uff1a \uff21\uff22\uff43",
    "\u1d00\u1d01 \u2c00\u2c01 \U00010400\U00010428 \U0001e900", "\u00b5\u00c0\u00d7\u00f7\u01bb",
]  # fmt: skip
SAMPLE = "Hello , world ! It 's a test . ' quoted ' I 'm here ."


def corpus() -> list[str]:
    texts = json.loads((HERE / "tokenizer_corpus.json").read_text())
    return [t for t in texts if len(t) <= 2000] + EXTRA


MARKS_TEXT = [
    "\u0915\u093f\u0924\u093e\u092c \u092a\u0922\u093c\u094b \u0928\u092e\u0938\u094d\u0924\u0947",
    "\u1780\u17b6\u1793\u17cb\u178f\u17c2 \u0e01\u0e34\u0e19\u0e02\u0e49\u0e32\u0e27",
    "e\u0301te\u0301 re\u0301sume\u0301 nai\u0308ve cafe\u0301 A\u030angstro\u0308m",
]


def marks_vocab() -> Path:
    """Train the small mark-joining BPE and write it as tests/data/tokenizer_bpe_marks.gguf."""
    from make_tokenizer_bpe_gguf import SPECIALS, write
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    texts = corpus() + MARKS_TEXT * 20
    for special, _ in SPECIALS:  # write() appends them; a trained duplicate breaks the vocab
        texts = [t.replace(special, " ") for t in texts]
    tok.train_from_iterator(texts, trainer=trainer)
    path = HERE / "tokenizer_bpe_marks.gguf"
    write(tok, "qwen35", path)
    from mgserve.core.gguf.reader import GGUFFile

    tokens = GGUFFile(path).metadata["tokenizer.ggml.tokens"]
    assert len(set(tokens)) == len(tokens), "duplicate token texts"
    return path


def write_vocab(meta: dict, pre: str, path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize(vocab: object, text: str) -> list[int]:
    data = text.encode()
    cap = len(data) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, False, False)
    assert n >= 0, n
    return list(buf[:n])


def detokenize(vocab: object, ids: list[int]) -> str:
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(64 * len(ids) + 16)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, True)
    assert n >= 0, n
    return buf.raw[:n].decode("utf-8", "replace")


def main() -> None:
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.core.text.pretok_types import PRE_TYPES  # only for the list of names
    from tests.core.test_tokenizer_llama_vectors import metadata

    vocabs = {"gpt-2": metadata("gpt-2"), "marks": GGUFFile(marks_vocab()).metadata}
    texts = corpus() + MARKS_TEXT
    sample_ids = None
    results: list[list[list[int]]] = []
    names: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(PRE_TYPES):
            if name == "whitespace":  # llama.cpp aborts: its words keep spaces, merges forbid them
                continue
            entry: dict[str, object] = {}
            for vocab_name, meta in vocabs.items():
                path = Path(tmp) / "vocab.gguf"
                write_vocab(meta, name, path)
                llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
                vocab = llm._model.vocab
                ids = [tokenize(vocab, t) for t in texts]
                if ids not in results:
                    results.append(ids)
                entry[vocab_name] = results.index(ids)
                if vocab_name != "gpt-2":
                    del llm
                    continue
                if sample_ids is None:
                    sample_ids = tokenize(vocab, SAMPLE)
                entry.update(
                    add_bos=bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
                    bos=llama_cpp.llama_vocab_bos(vocab),
                    sample_text=detokenize(vocab, sample_ids),
                )
                del llm
            names[name] = entry
    out = {"texts": texts, "sample": SAMPLE, "sample_ids": sample_ids, "ids": results}
    out["names"] = names
    target = HERE / "tokenizer_ref_pretok.json.gz"
    data = json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()
    target.write_bytes(gzip.compress(data, 9, mtime=0))
    print(target, target.stat().st_size, "bytes,", len(results), "distinct results")


if __name__ == "__main__":
    main()
