"""BPE encoding (``tokenizer.ggml.model`` "gpt2", and "gemma4"), identical to llama.cpp's
``llm_tokenizer_bpe_session``: the pre-tokenizer named by ``tokenizer.ggml.pre`` (pretok_types.py,
pretok.py) splits the text into words, each word's UTF-8 bytes are mapped to GPT-2's printable
characters (not for gemma4-style vocabs, whose words stay raw UTF-8), and within a word the pair
with the lowest merge rank (the line of ``tokenizer.ggml.merges``) is merged until no pair has a
rank (merge.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mgserve.core.text.merge import ABSORBED, encode_words, merge
from mgserve.core.text.pretok import PreTokenizer
from mgserve.core.text.pretok_types import REGEXES, PreType


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def decode_text(token_text: str) -> bytes:
    """A normal BPE token's bytes (llama.cpp's llama_decode_text, quirks included)."""
    out = bytearray()
    for ch in token_text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + token_text.encode() + b"]"
    return bytes(out)


class BpeEncoder:
    def __init__(
        self,
        pre: PreType,
        token_to_id: Mapping[str, int],
        merges: Sequence[str],
    ) -> None:
        self.pretok = PreTokenizer(REGEXES[pre.regexes])
        self.ignore_merges = pre.ignore_merges
        self.byte_encode = pre.byte_encode
        self.newline_words = pre.newline_words
        self.token_to_id = token_to_id
        # Symbols are the texts merges name, interned as ints; each merge is one entry of the pair
        # table (left << 32 | right -> rank << 32 | merged symbol) that merge.merge looks up.
        self.sym_id: dict[str, int] = {}
        self.sym_text: list[str] = []
        self.pairs: dict[int, int] = {}
        intern = self._intern
        for rank, merge_line in enumerate(merges):
            # llama.cpp splits at the first space after position 0
            pos = merge_line.find(" ", 1)
            left, right = (merge_line[:pos], merge_line[pos + 1 :]) if pos >= 0 else ("", "")
            key = intern(left) << 32 | intern(right)
            if key not in self.pairs:  # the first rank of a repeated pair counts
                self.pairs[key] = rank << 32 | intern(left + right)
        self.pair = self.pairs.get
        self.cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        encode_words(self.pre_tokenize(text), self.cache, self._word_ids, out)

    def pre_tokenize(self, text: str) -> list[str]:
        return self.pretok.split(text)

    def symbol_ids(self, word: str) -> list[int]:
        """The symbols a (byte-encoded) word starts as: -1 for a character no merge names."""
        get = self.sym_id.get
        return [get(ch, -1) for ch in word]

    def _intern(self, text: str) -> int:
        i = self.sym_id.get(text)
        if i is None:
            i = self.sym_id[text] = len(self.sym_text)
            self.sym_text.append(text)
        return i

    def _word_ids(self, word: str) -> list[int]:
        if self.byte_encode:
            word = word.encode().decode("latin-1").translate(BYTE_TO_CHAR)
        tid = self.token_to_id
        if self.ignore_merges and word in tid:
            return [tid[word]]
        if self.newline_words and word in tid and not word.strip("\n"):
            return [tid[word]]
        text = self.sym_text
        merged = merge(self.symbol_ids(word), self.pair)
        syms = [text[i] if i >= 0 else word[k] for k, i in enumerate(merged) if i != ABSORBED]
        out: list[int] = []
        for sym in syms:
            t = tid.get(sym)
            if t is not None:
                out.append(t)
            elif self.byte_encode:  # each UTF-8 byte as a one-byte token text; misses dropped
                for byte in sym.encode():
                    t = tid.get(chr(byte)) if byte < 0x80 else None
                    if t is not None:
                        out.append(t)
            else:  # raw UTF-8 vocabs fall back to <0xXX> byte tokens; misses dropped
                for byte in sym.encode():
                    t = tid.get(f"<0x{byte:02X}>")
                    if t is not None:
                        out.append(t)
        return out
