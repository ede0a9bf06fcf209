"""Write the tiny byte-level BPE GGUF files used by tests/core/test_tokenizer.py (run once).

There is no real BPE model on disk, so we train a small byte-level BPE with the ``tokenizers``
library and store it as vocab-only GGUFs, one per pre-tokenizer that mgserve must match
(``qwen2``, ``llama-bpe``, ``default``). The files are committed; this script documents how they
were made:

    python tests/data/make_tokenizer_bpe_gguf.py
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
PRE_TYPES = ("qwen2", "llama-bpe", "default")
# (text, GGUF token type): 3 = control, 4 = user-defined
SPECIALS = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<tool>", 4),
    ("</tool>", 4),
]


def training_text() -> list[str]:
    corpus = json.loads((HERE / "tokenizer_corpus.json").read_text())
    code = [inspect.getsource(m) for m in (textwrap, json.decoder, json.encoder)]
    return corpus + code


def train(vocab_size: int = 1200) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


def write(tok: Tokenizer, pre: str, path: Path) -> None:
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [1] * len(tokens)
    for text, ty in SPECIALS:
        tokens.append(text)
        types.append(ty)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    eot = tokens.index("<|endoftext|>")

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    tok = train()
    for pre in PRE_TYPES:
        path = HERE / f"tokenizer_bpe_{pre}.gguf"
        write(tok, pre, path)
        print(path, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
