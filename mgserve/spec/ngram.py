"""A session's n-gram index over its own tokens (prompt and output): the drafts that followed the
most recent earlier occurrence of the longest suffix that occurred before.

For each key length n in [n_min, n_max] a dict maps the hash of an n-gram to the position just
after its most recent occurrence that ends before the last token (the suffix itself is never its
own match). Each appended token adds one n-gram per key length, ending one token before the new
end: O(n_max - n_min + 1) work per token, never a rescan of the history. Indexing is lazy: tokens
are only appended until a ``propose`` needs the tables, so a session that never drafts (a busy
server, a request that turned speculation off) pays one list append per token. A long stretch
(the prompt, at the first ``propose``) is hashed with numpy in one pass per key length, about
1.5 us a token on one CPU core (0.4 s for 250k tokens, ~110 bytes a token per key length); a few
tokens at a time go through plain ints. Both give the same hashes (the tests compare them with a
brute-force scan).

The hash of tokens t[q-n+1 .. q] is sum_i t[q-i] * B^i mod 2^64 (the newest token at B^0, so one
pass over i = 0, 1, ... gives every key length). A hash names a candidate only: the tokens are
compared before a draft is taken, so a collision costs at most a missed draft, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MASK = (1 << 64) - 1
BASE = 0x9E3779B97F4A7C15  # odd, so multiplying by it mod 2^64 loses nothing
BULK = 64  # appends at least this long are hashed with numpy


class NgramIndex:
    """One session's tokens and their n-gram tables; fresh per session, nothing shared."""

    def __init__(self, n_min: int = 2, n_max: int = 8) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram key lengths need 1 <= min <= max, got {n_min}, {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self.tokens: list[int] = []
        self._done = 0  # tokens indexed: the tables hold the n-grams ending before the last one
        # tables[n - n_min]: hash of an n-gram -> the position after its most recent occurrence
        self._tables: list[dict[int, int]] = [{} for _ in range(n_max - n_min + 1)]
        self._pow = [pow(BASE, i, 1 << 64) for i in range(n_max)]
        self._last: tuple[int, list[int]] = (-1, [])  # the last suffix hashes: (end, hashes)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (in order); they are indexed at the next ``propose``."""
        self.tokens.extend(tokens)

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        suffix (n_max down to n_min tokens) that occurred before; () when none did."""
        toks = self.tokens
        n_tok = len(toks)
        if k <= 0 or n_tok <= self.n_min:
            return ()
        self._catch_up()
        hashes = self._suffix_hashes(n_tok)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            after = self._tables[n - self.n_min].get(hashes[n - 1])
            if after is not None and toks[after - n : after] == toks[n_tok - n :]:
                return tuple(toks[after : min(after + k, n_tok)])
        return ()

    # -- indexing --------------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Index the n-grams of the tokens appended since the last ``propose``."""
        old, new = self._done, len(self.tokens)
        if new - old >= BULK:
            self._index_bulk(old, new)
        else:
            for end in range(old, new):
                self._index_at(end)
        self._done = new

    def _suffix_hashes(self, end: int) -> list[int]:
        """The hashes of the n-grams ending just before ``end``, for n = 1 .. n_max (as far as
        the history goes)."""
        if self._last[0] == end:  # propose's, which the next token's indexing needs again
            return self._last[1]
        toks, pw = self.tokens, self._pow
        out, h = [], 0
        for i in range(min(self.n_max, end)):
            h = (h + toks[end - 1 - i] * pw[i]) & MASK
            out.append(h)
        self._last = (end, out)
        return out

    def _index_at(self, length: int) -> None:
        """The history has grown past ``length`` tokens: index the n-grams ending at ``length``
        (exclusive), which the token at ``length`` followed."""
        hashes = self._suffix_hashes(length)
        for n in range(self.n_min, len(hashes) + 1):
            self._tables[n - self.n_min][hashes[n - 1]] = length

    def _index_bulk(self, old: int, new: int) -> None:
        """``_index_at`` for every length in [old, new) at once, in order (the most recent wins)."""
        lo = max(0, old - self.n_max)  # the tokens the first new n-grams reach back to
        arr = np.asarray(self.tokens[lo : new - 1], dtype=np.uint64)  # [m]
        h = np.zeros(len(arr), dtype=np.uint64)  # h[j]: n-gram ending at lo + j (inclusive)
        for n in range(1, min(self.n_max, len(arr)) + 1):
            h[n - 1 :] += arr[: len(arr) - n + 1] * np.uint64(self._pow[n - 1])
            first = max(old, n)  # n-grams end (exclusive) at first .. new - 1
            if n >= self.n_min and first < new:
                keys = h[first - 1 - lo :].tolist()
                self._tables[n - self.n_min].update(zip(keys, range(first, new), strict=True))
