"""Byte-level BPE encoding (``tokenizer.ggml.model == "gpt2"``), identical to llama.cpp's
``llm_tokenizer_bpe_session``: the pre-tokenizer named by ``tokenizer.ggml.pre`` splits the text
into words, each word's UTF-8 bytes are mapped to GPT-2's printable characters, and within a word
the pair with the lowest merge rank (ties: leftmost) is merged until no pair has a rank.

Words are independent, so caching ids per word is exact. The pre-tokenizer regexes are
llama.cpp's (llama-vocab.cpp) with ``\\s`` spelled out as llama.cpp's whitespace set
(unicode-data.cpp), which differs from Python's: ``\\x1c``-``\\x1f`` are not whitespace there.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import regex

# llama.cpp's unicode_set_whitespace, as regex class contents
_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = (
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+| ?\p{{N}}+| ?[^{_WS}\p{{L}}\p{{N}}]+|[{_WS}]+(?![^{_WS}])"
)


def _llama3_like(digits: str) -> str:
    return (
        rf"{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{digits}"
        rf"| ?[^{_WS}\p{{L}}\p{{N}}]+[\r\n]*|[{_WS}]*[\r\n]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
    )


# pre-tokenizer kind -> regexes applied one after another; text a regex does not match stays a
# word of its own (llama.cpp's unicode_regex_split)
_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_llama3_like("{1,3}"),),
    "qwen2": (_llama3_like(""),),
    "gpt2": (_GPT2,),
}
# tokenizer.ggml.pre value -> (kind, ignore_merges, add_bos default, clean_spaces)
PRE_TYPES: dict[str, tuple[str, bool, bool, bool]] = {
    "default": ("default", False, False, True),
    **{
        name: ("llama3", True, True, True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")
    },
    **{name: ("qwen2", False, False, False) for name in ("qwen2", "deepseek-r1-qwen")},
    **{name: ("gpt2", False, False, True) for name in ("gpt-2", "phi-2", "jina-es", "jina-de")},
}
_CACHE_LIMIT = 200_000


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
        kind: str,
        ignore_merges: bool,
        token_to_id: Mapping[str, int],
        merges: Sequence[str],
    ) -> None:
        self.regexes = [regex.compile(r) for r in _REGEXES[kind]]
        self.ignore_merges = ignore_merges
        self.token_to_id = token_to_id
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            # llama.cpp splits at the first space after position 0
            pos = merge.find(" ", 1)
            pair = (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")
            self.ranks.setdefault(pair, rank)
        self.cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        cache = self.cache
        for word in self.pre_tokenize(text):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                encoded = word.encode().decode("latin-1").translate(BYTE_TO_CHAR)
                ids = cache[word] = tuple(self._merge(encoded))
            out.extend(ids)

    def pre_tokenize(self, text: str) -> list[str]:
        words = [text]
        for rx in self.regexes:
            split: list[str] = []
            for word in words:
                pos = 0
                for m in rx.finditer(word):
                    if m.start() > pos:
                        split.append(word[pos : m.start()])
                    split.append(m.group())
                    pos = m.end()
                if pos < len(word):
                    split.append(word[pos:])
            words = split
        return words

    def _merge(self, word: str) -> list[int]:
        tid = self.token_to_id
        if self.ignore_merges and word in tid:
            return [tid[word]]
        ranks = self.ranks
        syms = list(word)  # "" marks a symbol absorbed by its left neighbour
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, int]] = []  # (rank, left, right, size)
        for i in range(n - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None:
                heap.append((r, i, i + 1, 2))
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # stale
            syms[left] = a + b
            syms[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                r = ranks.get((syms[before], syms[left]))
                if r is not None:
                    heapq.heappush(heap, (r, before, left, len(syms[before]) + size))
            if after >= 0:
                r = ranks.get((syms[left], syms[after]))
                if r is not None:
                    heapq.heappush(heap, (r, left, after, size + len(syms[after])))
        out: list[int] = []
        for sym in syms:
            if not sym:
                continue
            t = tid.get(sym)
            if t is not None:
                out.append(t)
            else:  # llama.cpp looks up each UTF-8 byte as a one-byte token and drops misses
                for byte in sym.encode():
                    t = tid.get(chr(byte)) if byte < 0x80 else None
                    if t is not None:
                        out.append(t)
        return out
