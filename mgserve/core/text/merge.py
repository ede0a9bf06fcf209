"""Greedy pair merging within a word, as llama.cpp's BPE and SentencePiece sessions do it.

A word starts as a list of symbols; repeatedly, the adjacent pair with the lowest rank (ties: the
leftmost) is merged into one symbol, until no adjacent pair has a rank. ``merge`` takes symbols
interned as ints and a pair lookup, ``left << 32 | right`` -> ``rank << 32 | merged symbol`` or
None (bpe.py: the rank is the merge's line in the file). spm.py runs the same two loops over
substrings of the word instead (a rank there is the merged token's score; see its comment).

Symbols sit in a linked list and candidate pairs in a heap of ``rank << 32 | position`` (ints, so
the heap orders them as llama.cpp does); entries made stale by a neighbour's merge are skipped
when popped. A word of n symbols costs O(n log n), however long it is.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

CACHE_LIMIT = 200_000  # words; an encoder's word cache is cleared when full, to stay bounded
ABSORBED = -2  # the id ``merge`` leaves where a symbol was merged into its left neighbour
LONG = 256  # symbols; longer words are merged rank by rank first (_by_rank)
_MASK = 0xFFFFFFFF

PairLookup = Callable[[int], int | None]  # left << 32 | right -> rank << 32 | merged


def encode_words(
    words: Iterable[str],
    cache: dict[str, tuple[int, ...]],
    ids_of: Callable[[str], list[int]],
    out: list[int],
) -> None:
    """Append the ids of ``words`` to ``out``. Words are merged independently, so caching each
    word's ids is exact; the cache is cleared when full so a long-running server stays bounded."""
    for word in words:
        ids = cache.get(word)
        if ids is None:
            if len(cache) >= CACHE_LIMIT:
                cache.clear()
            ids = cache[word] = tuple(ids_of(word))
        out.extend(ids)


def merge(ids: list[int], pair: PairLookup) -> list[int]:
    """The symbols of one word after merging, in place: a merged symbol's id at its left
    position and ``ABSORBED`` at its right one. A negative id is a symbol that never merges."""
    if len(ids) > LONG:
        merged = _by_rank(list(ids), pair)
        if merged is not None:
            return merged
    return _by_heap(ids, pair) if ids else ids


def links(n: int) -> tuple[list[int], list[int]]:
    """Next and previous symbol of each position (-1: none)."""
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    return nxt, list(range(-1, n - 1))


def _by_heap(ids: list[int], pair: PairLookup) -> list[int]:
    """llama.cpp's order exactly: a heap of rank << 32 | position, stale entries skipped."""
    nxt, prev = links(len(ids))
    heap = []
    for i in range(len(ids) - 1):
        a, b = ids[i], ids[i + 1]
        if a >= 0 and b >= 0:
            v = pair(a << 32 | b)
            if v is not None:
                heap.append((v >> 32) << 32 | i)
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        e = pop(heap)
        left = e & _MASK
        a = ids[left]
        right = nxt[left]
        if a < 0 or right < 0:
            continue  # stale: absorbed, or nothing to its right any more
        b = ids[right]
        v = pair(a << 32 | b) if b >= 0 else None
        # An entry is acted on when the pair now at its position still has its rank: llama.cpp
        # pushes every new adjacent pair, so it holds a live entry with this same key and would
        # merge the same pair at this same point of its order.
        if v is None or v >> 32 != e >> 32:
            continue  # stale: a neighbour changed since this pair was pushed
        m = ids[left] = v & _MASK
        ids[right] = ABSORBED
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prev[after] = left
            c = ids[after]
            if c >= 0:
                w = pair(m << 32 | c)
                if w is not None:
                    push(heap, (w >> 32) << 32 | left)
        before = prev[left]
        if before >= 0:
            c = ids[before]
            if c >= 0:
                w = pair(c << 32 | m)
                if w is not None:
                    push(heap, (w >> 32) << 32 | before)
    return ids


def _by_rank(ids: list[int], pair: PairLookup) -> list[int] | None:
    """The same merges for long words, cheaper: when every pair a merge creates has a higher
    rank than the merge itself (true of trained vocabs: a token is created before merges use
    it), llama.cpp's heap pops ranks in increasing order, so each rank's positions can be taken
    together, left to right, from a bucket. None when a created pair breaks that order; the
    caller then uses the heap."""
    nxt, prev = links(len(ids))
    buckets: dict[int, list[int]] = {}
    for i in range(len(ids) - 1):
        a, b = ids[i], ids[i + 1]
        if a >= 0 and b >= 0:
            v = pair(a << 32 | b)
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
            v = pair(a << 32 | b) if b >= 0 else None
            if v is None or v >> 32 != r:
                continue  # stale
            m = ids[left] = v & _MASK
            ids[right] = ABSORBED
            after = nxt[right]
            nxt[left] = after
            before = prev[left]
            for pos, key in (
                (left, m << 32 | ids[after] if after >= 0 else -1),
                (before, ids[before] << 32 | m if before >= 0 else -1),
            ):
                if key < 0:
                    continue  # no neighbour, or one that never merges (negative id)
                w = pair(key)
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
