"""A synthetic byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``) of any size.

llama.cpp needs, for a BPE vocabulary to load and tokenize: one distinct string per token id, a
merges array, and a token for every byte in GPT-2's byte-to-unicode alphabet (a piece that no
merge covers falls back to its bytes, and a missing byte token is a hard error). So ids 0..255 are
the 256 byte tokens, a few merges build common pairs, the filler tokens are distinct strings that
no text produces, and the last ids are the Qwen control tokens at their real positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

from gguf.constants import GGUFValueType

TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@cache
def chat_template(name: str) -> str:
    """``chatml`` (a minimal ChatML template), or a template shipped in mgserve/core/text/data
    (``qwen35``: Qwen3.5's own, see data/README.md)."""
    if name == "chatml":
        return CHATML_TEMPLATE
    path = files("mgserve.core.text") / "data" / f"{name}_template.jinja"
    if not path.is_file():
        raise ValueError(f"no chat template {name!r} in mgserve/core/text/data")
    return path.read_text(encoding="utf-8")


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: byte value b -> the printable character that stands for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@dataclass(frozen=True)
class SynthVocab:
    n_vocab: int  # total token count (the embedding's row count)
    pre: str  # tokenizer.ggml.pre: selects llama.cpp's pre-tokenizer regex
    endoftext_id: int  # <|endoftext|>: bos/pad, as in Qwen files
    im_start_id: int
    im_end_id: int  # eos
    template: str = "chatml"  # tokenizer.chat_template: a name ``chat_template`` knows

    def __post_init__(self) -> None:
        if self.n_vocab < 300:
            raise ValueError(
                f"a synthetic BPE vocabulary needs at least 300 tokens, got {self.n_vocab}"
            )
        ids = (self.endoftext_id, self.im_start_id, self.im_end_id)
        if len(set(ids)) != 3 or min(ids) < 256 + len(_MERGES) or max(ids) >= self.n_vocab:
            raise ValueError(
                f"special token ids {ids} must be distinct and in [256+merges, n_vocab)"
            )

    def metadata(self) -> dict[str, tuple[Any, GGUFValueType | None]]:
        """``tokenizer.*`` keys -> (value, explicit GGUF type or None to infer)."""
        alphabet = byte_alphabet()
        tokens = list(alphabet)
        merges = []
        for a, b in _MERGES:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
        specials = {
            self.endoftext_id: "<|endoftext|>",
            self.im_start_id: "<|im_start|>",
            self.im_end_id: "<|im_end|>",
        }
        types = [TOKEN_NORMAL] * self.n_vocab
        for i in range(len(tokens), self.n_vocab):
            # "<unused_N>" can never come out of the byte-level alphabet ('<' and '_' are bytes, but
            # nothing merges them), so filler tokens are distinct and unreachable
            tokens.append(specials.get(i, f"<unused_{i}>"))
        for i in specials:
            types[i] = TOKEN_CONTROL
        u32 = GGUFValueType.UINT32
        return {
            "tokenizer.ggml.model": ("gpt2", None),
            "tokenizer.ggml.pre": (self.pre, None),
            "tokenizer.ggml.tokens": (tokens, GGUFValueType.STRING),
            "tokenizer.ggml.token_type": (types, GGUFValueType.INT32),
            "tokenizer.ggml.merges": (merges, GGUFValueType.STRING),
            "tokenizer.ggml.eos_token_id": (self.im_end_id, u32),
            "tokenizer.ggml.padding_token_id": (self.endoftext_id, u32),
            "tokenizer.ggml.bos_token_id": (self.endoftext_id, u32),
            "tokenizer.ggml.add_bos_token": (False, None),
            "tokenizer.chat_template": (chat_template(self.template), None),
        }


# "Ġ" is GPT-2's stand-in for the space byte; a few pairs so the merges array is real
_MERGES: list[tuple[str, str]] = [
    ("Ġ", "t"),
    ("Ġ", "a"),
    ("h", "e"),
    ("i", "n"),
    ("r", "e"),
    ("o", "n"),
    ("Ġt", "he"),
    ("e", "r"),
]
