"""Finding markers in streamed text without emitting what may still become one.

``split_at_marker`` says where the first whole marker is, or how much of the text's tail must be
held back because it is the start of a marker that the next chunk may complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Split(NamedTuple):
    safe: str  # text before the marker (or before the held tail): decided
    marker: str | None  # the marker found, None if there is none yet
    rest: str  # after the marker, or the held tail when there is no marker


def held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def split_at_marker(text: str, markers: Sequence[str]) -> Split:
    """The earliest whole marker in ``text`` (the longest one at that place), else the text with
    the tail that could start a marker held back."""
    hits = [(text.find(m), -len(m), m) for m in markers if m and m in text]
    if hits:
        at, _, m = min(hits)
        return Split(text[:at], m, text[at + len(m) :])
    hold = held_tail(text, markers)
    return Split(text[: len(text) - hold], None, text[len(text) - hold :])


def trailing_space(text: str) -> int:
    """How many whitespace characters ``text`` ends with."""
    return len(text) - len(text.rstrip())
