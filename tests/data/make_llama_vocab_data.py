"""Keep llama.cpp's tokenizer test vectors as test data (run once; tests/core/
test_tokenizer_llama_vectors.py reads what this writes).

llama.cpp ships vocab-only GGUFs with input texts and expected ids for its test-tokenizer-0
(``models/ggml-vocab-NAME.gguf`` + ``.inp`` + ``.out``). This finds them in the llama-cpp-python
0.3.36 source distribution (an unpacked directory or the .tar.gz that
``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` fetches) and writes to
tests/data/llama_vocab/:

- ``NAME.inp`` / ``NAME.out``: the vectors as shipped;
- ``NAME.meta.json``: the vocab's scalar metadata (tokenizer.*, general.name/architecture) and the
  name of its arrays file;
- ``ARRAYS.arrays.xz``: tokens, merges, token types and scores in a compact container (the GGUFs
  are 55 MB; this is about 9 MB; vocabs with identical arrays, qwen2 and qwen35, share one);
- ``NAME.llama.json``: when llama-cpp-python is importable, llama.cpp's own ids for every case
  (and for the EXTRA texts below, after the cases)
  with each (add_special, parse_special) combination, so the test checks against the library
  as well as against the shipped ``.out`` (which is add_special = parse_special = false), and
  the detokenized text of the (true, true) ids with special tokens rendered and not.

    python tests/data/make_llama_vocab_data.py [SDIST]
"""

from __future__ import annotations

import hashlib
import json
import lzma
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
OUT = HERE / "llama_vocab"
sys.path.insert(0, str(HERE.parent.parent))  # the repository root, for mgserve.core.gguf.reader
DEFAULT = Path("/tmp/sdist/llama_cpp_python-0.3.36")
VOCABS = (
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
SEPARATOR = "\n__ggml_vocab_test__\n"  # between .inp cases (test-tokenizer-0.cpp)
# appended to every vocab's cases for the llama.cpp comparison: special-token texts of many
# families next to whitespace (parse_special and LSTRIP / RSTRIP rules, e.g. phi-3's)
EXTRA = [
    "<s> hi </s>  x <unk>\n",
    "<|endoftext|>\n  a<|endoftext|>",
    "<|assistant|>  \n hi <|end|> ",
    "[CLS] a [SEP] [MASK]  b [UNK]",
    "<mask>  b <pad>",
    "<start_of_turn>user\n hi<end_of_turn>",
    "<|im_start|>  x<|im_end|>\n",
    "<bos><eos>  <|begin_of_text|> <|eot_id|>",
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|> x",
    "<｜begin▁of▁sentence｜>  y",
    "\t<s>\t</s>\t",
]
ARRAYS = (
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)  # fmt: skip


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


def pack_arrays(meta: dict) -> bytes:
    """Container: a JSON header line, then the arrays' bytes. A string array is its UTF-8 byte
    lengths (uint32) followed by the concatenated text."""
    header: dict[str, list] = {}
    blobs: list[bytes] = []
    offset = 0
    for key in ARRAYS:
        value = meta.get(key)
        if value is None:
            continue
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            data = [s.encode() for s in value]
            blob = np.asarray([len(d) for d in data], dtype="<u4").tobytes() + b"".join(data)
            kind = "str"
        else:
            arr = np.asarray(value)
            kind = "<f4" if arr.dtype.kind == "f" else "<i4"
            blob = arr.astype(kind).tobytes()
        header[key] = [kind, offset, len(blob), len(value)]
        blobs.append(blob)
        offset += len(blob)
    return json.dumps(header).encode() + b"\n" + b"".join(blobs)


def unpack_arrays(raw: bytes) -> dict[str, object]:
    """The inverse of pack_arrays (tests/core/test_tokenizer_llama_vectors.py reads with it)."""
    line, _, body = raw.partition(b"\n")
    out: dict[str, object] = {}
    for key, (kind, offset, size, count) in json.loads(line).items():
        blob = body[offset : offset + size]
        if kind == "str":
            lengths = np.frombuffer(blob[: 4 * count], dtype="<u4")
            ends = np.cumsum(lengths).tolist()
            text = blob[4 * count :]
            out[key] = [
                text[e - n : e].decode() for e, n in zip(ends, lengths.tolist(), strict=True)
            ]
        else:
            out[key] = np.frombuffer(blob, dtype=kind)
    return out


def keep_vocab(meta: dict, folder: Path, meta_name: str, arrays_name: str = "") -> Path:
    """Write ``meta_name`` (scalar metadata) and the arrays file it names into ``folder``; the
    arrays file is named by its content unless ``arrays_name`` is given."""
    packed = pack_arrays(meta)
    arrays_name = arrays_name or f"{hashlib.sha256(packed).hexdigest()[:12]}.arrays.xz"
    target = folder / arrays_name
    if not target.exists():
        target.write_bytes(lzma.compress(packed, preset=9 | lzma.PRESET_EXTREME))
    scalars = {
        k: (v.item() if isinstance(v, np.generic) else v)
        for k, v in meta.items()
        if k.startswith(("tokenizer.ggml.", "general.name", "general.architecture"))
        and k not in ARRAYS
        and not isinstance(v, (list, np.ndarray))
    }
    (folder / meta_name).write_text(
        json.dumps({"arrays": target.name, "metadata": scalars}, indent=1) + "\n"
    )
    return target


def llama_ids(path: Path, cases: list[str]) -> dict[str, list] | None:
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python not importable: no NAME.llama.json written")
        return None
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    out: dict[str, list] = {}
    for add in (False, True):
        for parse in (False, True):
            key = f"{int(add)}{int(parse)}"
            out[key] = []
            for text in cases:
                data = text.encode()
                cap = len(data) + 16
                buf = (llama_cpp.llama_token * cap)()
                n = llama_cpp.llama_tokenize(
                    llm._model.vocab, data, len(data), buf, cap, add, parse
                )
                assert n >= 0, (path.name, text, n)
                out[key].append(list(buf[:n]))
    for unparse in (True, False):  # whole-sequence text of the (true, true) ids
        out[f"text{int(unparse)}"] = [
            detokenize(llama_cpp, llm._model.vocab, ids, unparse) for ids in out["11"]
        ]
    return out


def detokenize(llama_cpp: object, vocab: object, ids: list[int], unparse: bool) -> str:
    import ctypes

    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    cap = 64 * len(ids) + 16
    buf = ctypes.create_string_buffer(cap)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, cap, False, unparse)
    assert n >= 0, n
    return buf.raw[:n].decode("utf-8", "replace")


def models_dir(sdist: Path, tmp: Path) -> Path:
    if sdist.is_dir():
        return sdist / "vendor" / "llama.cpp" / "models"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/models/ggml-vocab-" in m.name]
        tar.extractall(tmp, members=members, filter="data")
    return next(tmp.glob("*/vendor/llama.cpp/models"))


def main() -> None:
    from mgserve.core.gguf.reader import GGUFFile

    sdist = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        models = models_dir(sdist, Path(tmp))
        for name in VOCABS:
            path = models / f"ggml-vocab-{name}.gguf"
            target = keep_vocab(GGUFFile(path).metadata, OUT, f"{name}.meta.json")
            for ext in ("inp", "out"):
                (OUT / f"{name}.{ext}").write_bytes(Path(f"{path}.{ext}").read_bytes())
            cases = split_cases(Path(f"{path}.inp").read_bytes().decode())
            ref = llama_ids(path, cases + EXTRA)
            if ref is not None:
                (OUT / f"{name}.llama.json").write_text(
                    json.dumps(ref, separators=(",", ":")) + "\n"
                )
            print(name, len(cases), "cases", target.name, target.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
