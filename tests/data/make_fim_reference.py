"""Record llama.cpp's fill-in-the-middle token ids and end-of-generation set for every vocab kept in
tests/data/llama_vocab and for Qwen2.5-Coder's (tests/core/coder_vocab.py), for
tests/core/test_fim_tokens.py (run once; needs llama-cpp-python 0.3.36):

    python tests/data/make_fim_reference.py

Each vocab is written as a vocab-only GGUF and loaded by llama.cpp (``vocab_only``), which reports
``llama_vocab_fim_{pre,suf,mid,pad,rep,sep}`` (-1: none) and ``llama_vocab_is_eog`` per token.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from gguf.constants import GGUFValueType

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository root
OUT = HERE / "llama_vocab" / "fim.json"
ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")


def write_vocab(meta: dict, path: Path) -> None:
    from mgserve.core.gguf.writer import GGUFWriter

    with GGUFWriter(path, str(meta.get("general.architecture", "llama"))) as w:
        for key, value in meta.items():
            if key == "general.architecture":  # the writer's own
                continue
            w.add(key, value, GGUFValueType.UINT32 if key.endswith("_token_id") else None)
        w.write_header()


def llama_facts(path: Path) -> dict[str, object]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    fim = {r: getattr(llama_cpp, f"llama_vocab_fim_{r}")(vocab) for r in ROLES}
    eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    return {"fim": fim, "eog": eog}


def main() -> None:
    from tests.core.coder_vocab import coder_metadata
    from tests.core.test_tokenizer_llama_vectors import metadata
    from tests.data.make_llama_vocab_data import VOCABS

    vocabs = {name: metadata(name) for name in VOCABS} | {"qwen2.5-coder": coder_metadata()}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, meta in vocabs.items():
            path = Path(tmp) / f"{name}.gguf"
            write_vocab(meta, path)
            out[name] = llama_facts(path)
            print(name, out[name]["fim"])
    OUT.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
