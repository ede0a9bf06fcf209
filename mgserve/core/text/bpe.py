"""BPE encoding (``tokenizer.ggml.model`` "gpt2", and "gemma4"), identical to llama.cpp's
``llm_tokenizer_bpe_session``: the pre-tokenizer named by ``tokenizer.ggml.pre``
(pretok.py) splits the text into words, each word's UTF-8 bytes are mapped to GPT-2's
printable characters (not for gemma4-style vocabs, whose words stay raw UTF-8), and within a
word the pair with the lowest merge rank (ties: leftmost) is merged until no pair has a rank.

Words are independent, so caching ids per word is exact. Merging keeps the symbols in a linked
list and the candidate pairs in a heap whose stale entries are skipped when popped, so a word of
n characters costs O(n log n), however long it is.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from mgserve.core.text.pretok import PreTokenizer, PreType

_CACHE_LIMIT = 200_000
_LONG = 256  # characters; longer words are merged rank by rank (BpeEncoder._by_rank)


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
        from mgserve.core.text.pretok import REGEXES

        self.pretok = PreTokenizer(REGEXES[pre.regexes])
        self.ignore_merges = pre.ignore_merges
        self.byte_encode = pre.byte_encode
        self.newline_words = pre.newline_words
        self.token_to_id = token_to_id
        # Symbols are interned as ints and each merge is one dict entry: (left << 32 | right)
        # -> (rank << 32 | merged symbol). Heap entries are ints too, rank << 32 | position, so
        # the heap orders them as llama.cpp does (lowest rank, then leftmost).
        self.sym_id: dict[str, int] = {}
        self.sym_text: list[str] = []
        self.pairs: dict[int, int] = {}
        intern = self._intern
        for rank, merge in enumerate(merges):
            # llama.cpp splits at the first space after position 0
            pos = merge.find(" ", 1)
            left, right = (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")
            key = intern(left) << 32 | intern(right)
            if key not in self.pairs:  # the first rank of a repeated pair counts
                self.pairs[key] = rank << 32 | intern(left + right)
        self.cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        cache = self.cache
        for word in self.pre_tokenize(text):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                if self.byte_encode:
                    encoded = word.encode().decode("latin-1").translate(BYTE_TO_CHAR)
                else:
                    encoded = word
                ids = cache[word] = tuple(self._merge(encoded))
            out.extend(ids)

    def _start(self, word: str) -> tuple[list[int], list[int], list[int]]:
        get = self.sym_id.get
        ids = [get(ch, -1) for ch in word]  # -1: a character no merge mentions; -2: absorbed
        n = len(ids)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        return ids, nxt, prev

    def _by_heap(self, word: str) -> list[int]:
        """llama.cpp's order exactly: a heap of rank << 32 | position, stale entries skipped."""
        pairs = self.pairs
        ids, nxt, prev = self._start(word)
        n = len(ids)
        mask = 0xFFFFFFFF
        heap = []
        for i in range(n - 1):
            a, b = ids[i], ids[i + 1]
            if a >= 0 and b >= 0:
                v = pairs.get(a << 32 | b)
                if v is not None:
                    heap.append((v >> 32) << 32 | i)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            e = pop(heap)
            left = e & mask
            a = ids[left]
            right = nxt[left]
            if a < 0 or right < 0:
                continue  # stale: absorbed, or nothing to its right any more
            b = ids[right]
            v = pairs.get(a << 32 | b) if b >= 0 else None
            # ranks name one pair each, so the same rank means the same two symbols: valid
            if v is None or v >> 32 != e >> 32:
                continue  # stale: a neighbour changed since this pair was pushed
            m = ids[left] = v & mask
            ids[right] = -2
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
                c = ids[after]
                if c >= 0:
                    w = pairs.get(m << 32 | c)
                    if w is not None:
                        push(heap, (w >> 32) << 32 | left)
            before = prev[left]
            if before >= 0:
                c = ids[before]
                if c >= 0:
                    w = pairs.get(c << 32 | m)
                    if w is not None:
                        push(heap, (w >> 32) << 32 | before)
        return ids

    def _by_rank(self, word: str) -> list[int] | None:
        """The same merges for long words, cheaper: when every pair a merge creates has a
        higher rank than the merge itself (true of trained vocabs: a token is created before
        merges use it), llama.cpp's heap pops ranks in increasing order, so each rank's
        positions can be taken together, left to right, from a bucket. None when a created pair
        breaks that order; the caller then uses the heap."""
        pairs = self.pairs
        ids, nxt, prev = self._start(word)
        mask = 0xFFFFFFFF
        buckets: dict[int, list[int]] = {}
        for i in range(len(ids) - 1):
            a, b = ids[i], ids[i + 1]
            if a >= 0 and b >= 0:
                v = pairs.get(a << 32 | b)
                if v is not None:
                    r = v >> 32
                    bucket = buckets.get(r)
                    if bucket is None:
                        buckets[r] = [i]
                    else:
                        bucket.append(i)
        order = list(buckets)
        heapq.heapify(order)
        pop, push = heapq.heappop, heapq.heappush
        while order:
            r = pop(order)
            positions = buckets.pop(r)
            positions.sort()
            for left in positions:
                a = ids[left]
                right = nxt[left]
                if a < 0 or right < 0:
                    continue
                b = ids[right]
                v = pairs.get(a << 32 | b) if b >= 0 else None
                if v is None or v >> 32 != r:
                    continue  # stale
                m = ids[left] = v & mask
                ids[right] = -2
                after = nxt[right]
                nxt[left] = after
                before = prev[left]
                for pos, key in (
                    (left, m << 32 | ids[after] if after >= 0 else -1),
                    (before, ids[before] << 32 | m if before >= 0 else -1),
                ):
                    if key < 0:
                        continue  # no neighbour, or one no merge mentions (id -1)
                    w = pairs.get(key)
                    if w is None:
                        continue
                    r2 = w >> 32
                    if r2 <= r:
                        return None
                    bucket = buckets.get(r2)
                    if bucket is None:
                        buckets[r2] = [pos]
                        push(order, r2)
                    else:
                        bucket.append(pos)
                if after >= 0:
                    prev[after] = left
        return ids

    def _intern(self, text: str) -> int:
        i = self.sym_id.get(text)
        if i is None:
            i = self.sym_id[text] = len(self.sym_text)
            self.sym_text.append(text)
        return i

    def pre_tokenize(self, text: str) -> list[str]:
        return self.pretok.split(text)

    def _merge(self, word: str) -> list[int]:
        tid = self.token_to_id
        if self.ignore_merges and word in tid:
            return [tid[word]]
        if self.newline_words and word in tid and not word.strip("\n"):
            return [tid[word]]
        if not word:
            return []
        ids = self._by_rank(word) if len(word) > _LONG else None
        if ids is None:
            ids = self._by_heap(word)
        text = self.sym_text
        syms = [text[i] if i >= 0 else word[k] for k, i in enumerate(ids) if i != -2]
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
