"""WordPiece encoding (``tokenizer.ggml.model == "bert"``), identical to llama.cpp's
``llm_tokenizer_wpm_session``. mgserve serves no BERT-like architecture; this exists so that
every vocabulary llama.cpp ships test vectors for loads and tokenizes the same.

The text is normalized and cut into words (whitespace separates words and is dropped; control
characters are dropped; punctuation, ASCII symbols and CJK ideographs are words of their own;
optionally lowercased and stripped of accents with llama.cpp's own Unicode tables), then each
word, with a leading ``▁``, is covered greedily by the longest vocab token at each position; a
word with an uncoverable position becomes the unknown token.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping

from mgserve.core.text import unicode as uni

_CJK = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)  # fmt: skip  # is_chinese_char; llama.cpp keeps HF's 0x2B920 where 0x2B820 was meant


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK)


class WpmEncoder:
    def __init__(
        self, token_to_id: Mapping[str, int], unk_id: int | None, lowercase: bool, strip: bool
    ) -> None:
        self.token_to_id = token_to_id
        self.unk_id = unk_id
        self.lowercase = lowercase
        self.strip_accents = strip
        self.max_len = max(len(t.encode()) for t in token_to_id)  # bytes

    def words(self, text: str) -> list[str]:
        flags = uni.flags()
        words: list[list[str]] = [[]]
        for ch in text:
            cp = ord(ch)
            if self.strip_accents:
                cp = uni.nfd_base(cp)
            f = int(flags[cp])
            if f & uni.WHITESPACE:
                if words[-1]:
                    words.append([])
                continue
            if cp in (0, 0xFFFD) or f & uni.CONTROL:
                continue
            if self.strip_accents and f & uni.MARK:
                continue
            s = chr(uni.tolower(cp) if self.lowercase else cp)
            if f & uni.PUNCTUATION or (cp < 0x7F and f & uni.SYMBOL) or _is_cjk(cp):
                if words[-1]:
                    words.append([])
                words[-1].append(s)
                words.append([])
            else:
                words[-1].append(s)
        return ["".join(w) for w in words if w]

    def encode(self, text: str, out: list[int]) -> None:
        tid = self.token_to_id
        for word in self.words(text):
            word = "\u2581" + word
            ends = [0]  # byte offset after each character
            for ch in word:
                ends.append(ends[-1] + len(ch.encode()))
            start = len(out)
            i = 0
            while i < len(word):
                last = bisect_right(ends, ends[i] + self.max_len + 1) - 1
                for j in range(min(last, len(word)), i, -1):  # longest first
                    t = tid.get(word[i:j])
                    if t is not None:
                        out.append(t)
                        i = j
                        break
                else:  # nothing covers position i: the whole word is unknown
                    del out[start:]
                    break
            if len(out) == start:
                if self.unk_id is None:
                    raise ValueError("WordPiece vocab without an unknown token")
                out.append(self.unk_id)
