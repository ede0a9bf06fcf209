"""SentencePiece-style encoding (``tokenizer.ggml.model == "llama"``), identical to llama.cpp's
``llm_tokenizer_spm_session``: spaces become ``▁``, then adjacent symbols are merged, best vocab
score first (ties: leftmost), until no adjacent pair forms a vocab token; what is left and is not
a token falls back to ``<0xNN>`` byte tokens.

llama.cpp merges over a whole text fragment; doing that in Python on 1 MB is slow, so we cut the
fragment into words before each ``▁`` and cache the ids of each word. The cut is exact: every
symbol llama.cpp ever forms is a contiguous substring that is a vocab token, so a merge can cross
a cut only if some vocab token occurs in the text across it. Tokens with ``▁`` after their first
character are the only ones that can cross a cut made before a ``▁``; wherever one of them
occurs we do not cut inside it. Merges on the two sides of a safe cut never interact, and the
priority order restricted to one side is the order llama.cpp uses, so the ids are identical.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence

from mgserve.core.text.merge import LONG, encode_words, links
from mgserve.core.text.special import trie_regex

SPACE = "\u2581"  # ▁
_WORD_RE = re.compile(f"{SPACE}[^{SPACE}]*|[^{SPACE}]+")


class SpmEncoder:
    def __init__(
        self, tokens: Sequence[str], token_to_id: Mapping[str, int], scores: Sequence[float]
    ) -> None:
        self.token_to_id = token_to_id
        # dense rank of each token's score, best first: heap entries are the int
        # rank << 32 | position, ordered as llama.cpp orders its bigrams (best score, leftmost)
        distinct = sorted(set(scores), reverse=True)
        order = {score: i for i, score in enumerate(distinct)}
        self.score_rank: list[int] = [order[x] for x in scores]
        crossing = {t for t in tokens if SPACE in t[1:]}
        # at each position the longest crossing token starting there (shorter ones span less)
        self.crossing = re.compile("(?=(" + trie_regex(crossing) + "))") if crossing else None
        self.byte_ids: list[int | None] = [None] * 256
        self.cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of one raw-text fragment (space prefix already applied) to ``out``."""
        encode_words(self._words(text.replace(" ", SPACE)), self.cache, self._merge, out)

    def _words(self, s: str) -> list[str]:
        if self.crossing is None:
            return _WORD_RE.findall(s)
        unsafe: set[int] = set()
        for m in self.crossing.finditer(s):
            unsafe.update(range(m.start() + 1, m.start() + len(m.group(1))))
        if not unsafe:
            return _WORD_RE.findall(s)
        words = []
        begin = 0
        for m in _WORD_RE.finditer(s):
            cut = m.start()
            if cut > begin and cut not in unsafe:
                words.append(s[begin:cut])
                begin = cut
        if begin < len(s):
            words.append(s[begin:])
        return words

    def _merge(self, word: str) -> list[int]:
        tid = self.token_to_id
        state = self._by_rank(word) if len(word) > LONG else None
        length, nxt = state if state is not None else self._by_heap(word)
        out: list[int] = []
        i = 0
        while i >= 0:
            piece = word[i : i + length[i]]
            t = tid.get(piece)
            if t is not None:
                out.append(t)
            else:
                out.extend(self._byte_id(b) for b in piece.encode())
            i = nxt[i]
        return out

    # _by_heap and _by_rank are merge.py's loops with the pair lookup written inline: symbol i
    # covers word[i : i + length[i]] (a symbol only ever absorbs its right neighbour, so its start
    # never moves; length 0 marks one absorbed), and a pair merges when its text is a token, at
    # the rank of that token's score. Slicing the word in place is what makes SentencePiece fast
    # here: merge.merge over interned symbols and a pair table cost 25% more on long words.
    def _by_heap(self, word: str) -> tuple[list[int], list[int]]:
        """llama.cpp's order exactly: a heap of score rank << 32 | position."""
        tid = self.token_to_id
        n = len(word)
        length = [1] * n
        nxt, prev = links(n)
        mask = 0xFFFFFFFF
        rank = self.score_rank
        heap = []
        for i in range(n - 1):
            t = tid.get(word[i : i + 2])
            if t is not None:
                heap.append(rank[t] << 32 | i)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        # An entry is acted on when the pair now at its position still has its score: llama.cpp
        # pushes every new adjacent pair, so it holds a live entry with this same key and would
        # merge the same pair at this same point of its order.
        while heap:
            e = pop(heap)
            left = e & mask
            size = length[left]
            right = nxt[left]
            if size == 0 or right < 0:
                continue
            size += length[right]
            t = tid.get(word[left : left + size])
            if t is None or rank[t] != e >> 32:
                continue  # stale
            length[left] = size
            length[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
                t = tid.get(word[left : left + size + length[after]])
                if t is not None:
                    push(heap, rank[t] << 32 | left)
            before = prev[left]
            if before >= 0:
                t = tid.get(word[before : before + length[before] + size])
                if t is not None:
                    push(heap, rank[t] << 32 | before)
        return length, nxt

    def _by_rank(self, word: str) -> tuple[list[int], list[int]] | None:
        """The same merges for long words, cheaper: while every pair a merge creates scores
        below the merge itself (true of trained vocabs), llama.cpp's heap pops score ranks in
        increasing order, so each rank's positions can be taken together, left to right, from a
        bucket. None when a created pair breaks that order; the caller then uses the heap."""
        tid = self.token_to_id
        rank = self.score_rank
        length = [1] * len(word)
        nxt, prev = links(len(word))
        buckets: dict[int, list[int]] = {}
        for i in range(len(word) - 1):
            t = tid.get(word[i : i + 2])
            if t is not None:
                bucket = buckets.get(rank[t])
                if bucket is None:
                    buckets[rank[t]] = [i]
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
                size = length[left]
                right = nxt[left]
                if size == 0 or right < 0:
                    continue
                size += length[right]
                t = tid.get(word[left : left + size])
                if t is None or rank[t] != r:
                    continue  # stale
                length[left] = size
                length[right] = 0
                after = nxt[right]
                nxt[left] = after
                before = prev[left]
                if after >= 0:
                    prev[after] = left
                for pos, end in ((left, after), (before, left)):
                    if pos < 0 or end < 0:
                        continue
                    t = tid.get(word[pos : pos + length[pos] + length[end]])
                    if t is None:
                        continue
                    r2 = rank[t]
                    if r2 <= r:
                        return None
                    bucket = buckets.get(r2)
                    if bucket is None:
                        buckets[r2] = [pos]
                        push(order, r2)
                    else:
                        bucket.append(pos)
        return length, nxt

    def _byte_id(self, b: int) -> int:
        t = self.byte_ids[b]
        if t is None:
            t = self.token_to_id.get(f"<0x{b:02X}>")
            if t is None and b < 0x80:
                t = self.token_to_id.get(chr(b))
            if t is None:
                raise ValueError(f"vocab has no byte-fallback token for byte 0x{b:02X}")
            self.byte_ids[b] = t
        return t
