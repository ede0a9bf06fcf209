"""The n-gram proposer on tiny token arrays with their expected drafts, and the index built one
token at a time, in bulk and mixed, against a brute-force scan of the history."""

from __future__ import annotations

import random

import pytest

from mgserve.spec.ngram import BULK, NgramIndex

# (tokens, k, n_min, n_max, expected drafts)
CASES = [
    pytest.param([], 4, 2, 4, (), id="empty"),
    pytest.param([1, 2, 3, 4, 5], 4, 2, 4, (), id="no-repeat-no-match"),
    pytest.param([1, 2, 3, 1, 2], 4, 2, 4, (3, 1, 2), id="bounded-by-history-end"),
    pytest.param([1, 2, 3, 4, 1, 2], 2, 2, 4, (3, 4), id="k-bounds-the-draft"),
    pytest.param([1, 2, 3, 4, 1, 2], 1, 2, 4, (3,), id="k-one"),
    pytest.param([1, 2, 3, 4, 1, 2], 0, 2, 4, (), id="k-zero"),
    # the suffix (1, 2) is followed by 3 at its first occurrence and by 9 at its latest
    pytest.param([1, 2, 3, 0, 1, 2, 9, 0, 1, 2], 3, 2, 4, (9, 0, 1), id="most-recent-wins"),
    # (7, 1, 2) occurred once, followed by 5; the bigram (1, 2) most recently by 6
    pytest.param([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 2, 2, 4, (5, 8), id="longest-key-wins"),
    pytest.param([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 2, 2, 2, (6, 7), id="shorter-max-key"),
    # a repeat of one token is shorter than the minimum key
    pytest.param([1, 5, 2, 5], 3, 2, 4, (), id="below-min-length"),
    pytest.param([1, 5, 2, 5], 3, 1, 4, (2, 5), id="min-length-one"),
    # (1, 2, 3) occurred; a minimum of 4 asks more than any repeat holds
    pytest.param([1, 2, 3, 9, 1, 2, 3], 2, 4, 6, (), id="min-length-respected"),
    # the continuation may run into the suffix itself
    pytest.param([4, 4, 4, 4], 5, 2, 3, (4,), id="overlapping-run"),
    pytest.param([1, 2, 1, 2, 1, 2], 8, 2, 3, (1, 2), id="period-two"),
    pytest.param([1, 2, 1, 2, 1, 2], 8, 2, 8, (1, 2), id="period-two-long-keys"),
    # the suffix alone (its only occurrence) is never its own match
    pytest.param([3, 1, 2], 4, 2, 4, (), id="suffix-is-not-its-own-match"),
]


@pytest.mark.parametrize(("tokens", "k", "n_min", "n_max", "drafts"), CASES)
def test_proposals(
    tokens: list[int], k: int, n_min: int, n_max: int, drafts: tuple[int, ...]
) -> None:
    one = NgramIndex(n_min, n_max)
    for t in tokens:  # indexed one token at a time
        one.extend([t])
        one.propose(1)
    assert one.propose(k) == drafts
    whole = NgramIndex(n_min, n_max)
    whole.extend(tokens)
    assert whole.propose(k) == drafts


def test_code_rewrite_drafts_the_rest_of_a_copied_line() -> None:
    line = [10, 11, 12, 13, 14, 15, 16, 17]
    idx = NgramIndex(2, 8)
    idx.extend([1, *line, 2, 3, 10, 11, 12])  # the answer starts repeating the line
    assert idx.propose(16) == (13, 14, 15, 16, 17, 2, 3, 10, 11, 12)
    idx.extend([13, 99])  # a change: no 2-gram ending in 99 occurred
    assert idx.propose(16) == ()
    idx.extend([15])  # (99, 15) never occurred, nor does 15 alone count
    assert idx.propose(4) == ()
    idx.extend([16])  # (15, 16) did: its continuation in the line
    assert idx.propose(4) == (17, 2, 3, 10)


def test_bad_key_lengths_are_refused() -> None:
    for n_min, n_max in ((0, 4), (3, 2)):
        with pytest.raises(ValueError, match="key lengths"):
            NgramIndex(n_min, n_max)


def brute(tokens: list[int], k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """Rescan the whole history: the longest suffix with an earlier occurrence, the latest one."""
    n_tok = len(tokens)
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        suffix = tokens[n_tok - n :]
        for after in range(n_tok - 1, n - 1, -1):
            if tokens[after - n : after] == suffix:
                return tuple(tokens[after : min(after + k, n_tok)])
    return ()


@pytest.mark.parametrize("seed", range(6))
def test_incremental_appends_match_a_rescan(seed: int) -> None:
    rng = random.Random(seed)
    n_min = rng.randint(1, 3)
    n_max = n_min + rng.randint(0, 6)
    vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat a lot
    idx = NgramIndex(n_min, n_max)
    history: list[int] = []
    for _ in range(60):
        size = rng.choice([1, 1, 1, 2, 5, BULK, BULK + 7, 200])
        new = [rng.randrange(vocab) for _ in range(size)]
        if rng.random() < 0.3 and len(history) > 10:  # copy a stretch of the history
            at = rng.randrange(len(history) - 5)
            new = history[at : at + size]
        idx.extend(new)
        history.extend(new)
        k = rng.randint(1, 20)
        assert idx.propose(k) == brute(history, k, n_min, n_max)
    fresh = NgramIndex(n_min, n_max)
    fresh.extend(history)
    for k in (1, 4, 16):
        assert fresh.propose(k) == idx.propose(k) == brute(history, k, n_min, n_max)
