"""The BPE pre-tokenizer: cuts text into words with a type's regex list (pretok_types.py) exactly
as llama.cpp 0.3.36's ``unicode_regex_split`` does.

Each regex cuts every piece of the previous step into its matches and the unmatched text between
them. Like llama.cpp we match the regexes that use ``\\p{..}`` against the collapsed text
(unicode.py) and the others against the code points with non-ASCII whitespace as ``\\x0b``,
``\\s`` being ASCII whitespace (C++'s std::regex in the C locale). The regexes llama.cpp runs
through hand-written splitters, and two that are quadratic when searched naively, are replaced by
splitters of our own.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from mgserve.core.text.pretok_types import (
    AFMOE_DIGITS,
    AYA_DIGITS,
    DIGIT_TRIPLES,
    KIMI,
    KIMI_COLLAPSED,
    REGEXES,
    TRAILING_SPACE,
)
from mgserve.core.text.unicode import C_SPACE, collapse, wide

# \p{..} -> (marker in the collapsed text, its ASCII members), as unicode.cpp rewrites them
_CATEGORY = {
    r"\p{N}": ("\xd1", "0-9"),
    r"\p{L}": ("\xd2", "A-Za-z"),
    r"\p{P}": ("\xd3", r"!-#%-*,-/:-;?-@\[-\]_\{\}"),
    r"\p{M}": ("\xd4", ""),
    r"\p{S}": ("\xd5", r"\$\+<->^`\|\~"),
    **{rf"\p{{{c}}}": ("\xd2", "A-Za-z") for c in ("Lu", "Ll", "Lt", "Lm", "Lo")},
}


def _rewrite(rx: str) -> str:
    """unicode.cpp's collapse of a regex: each known \\p{..} becomes its marker plus its ASCII
    members, bracketed unless already inside a class."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(rx):
        ch = rx[i]
        if ch == "[" and (i == 0 or rx[i - 1] != "\\"):
            inside = True
        elif inside and ch == "]" and rx[i - 1] != "\\":
            inside = False
        elif rx.startswith(r"\p{", i):
            close = rx.find("}", i + 3)
            if close != -1 and close <= i + 10 and rx[i : close + 1] in _CATEGORY:
                marker, members = _CATEGORY[rx[i : close + 1]]
                out.append(marker + members if inside else f"[{marker}{members}]")
                i = close + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


class _Trailing:
    """Stands in for a compiled ``\\s+$``: the match is the chunk's trailing whitespace."""

    def finditer(self, view: str, start: int, end: int) -> list[_Span]:
        s = len(view[start:end].rstrip(C_SPACE)) + start
        return [_Span(s, end)] if s < end else []


class _DigitGroups:
    """unicode_regex_split_custom_afmoe (AFMoE, Tiny Aya) on the collapsed text: each run of
    numbers is cut into a leading 1-2 and then groups of 3; the text before a run stays glued
    to the run's first group, text after the last run is one piece."""

    _RUN = re.compile("[\xd10-9]+")

    def finditer(self, view: str, start: int, end: int) -> list[_Span]:
        out: list[_Span] = []
        prev = start
        for m in self._RUN.finditer(view, start, end):
            a, q = m.span()
            cur = a + (q - a) % 3
            if cur > a:
                out.append(_Span(prev, cur))
                prev = cur
            while cur < q:
                cur += 3
                out.append(_Span(prev, cur))
                prev = cur
        if prev < end:
            out.append(_Span(prev, end))
        return out


class _DigitTriples:
    """Stands in for superbpe's ``(?=(\\d{3})+(?!\\d))``, which is quadratic in a digit run when
    searched naively: an empty match (a cut) wherever a positive multiple of 3 ASCII digits
    follows up to the end of the run."""

    _RUN = re.compile("[0-9]+")

    def finditer(self, view: str, start: int, end: int) -> list[_Span]:
        cuts: list[_Span] = []
        for m in self._RUN.finditer(view, start, end):
            a, q = m.span()
            cuts.extend(_Span(p, p) for p in range(q - 3 - (q - 3 - a) // 3 * 3, q, 3) if p >= a)
        return cuts


@dataclass(frozen=True)
class _Span:
    s: int
    e: int

    def span(self) -> tuple[int, int]:
        return self.s, self.e


# jais2's "\s*[\r\n]+" rescans a whitespace run from every match inside it, and its cascade
# takes at most 512 at a time: quadratic on a long run without newlines. Its view therefore
# marks whitespace with no newline later in its run (space -> \v, other -> \f; with one:
# space stays, other -> \t), which the regex never needs apart otherwise, and that alternative
# first checks the mark.
_NO_NEWLINE_AHEAD = str.maketrans({" ": "\v", "\t": "\f", "\v": "\f", "\f": "\f"})
_NEWLINE_AHEAD = str.maketrans({"\v": " ", "\f": "\t"})
_REVERSED_RUN = re.compile("[\r\n][\v\f\r\n]*")


def _jais2(collapsed_rx: str) -> str:
    for old, new in ((r"| ?[^\s", "|[ \v]?[^\\s"), (r"|\s*[\r\n]+", r"|(?=[ \t\r\n])\s*[\r\n]+")):
        assert collapsed_rx.count(old) == 1, old
        collapsed_rx = collapsed_rx.replace(old, new)
    return collapsed_rx


def _view(text: str, kind: str) -> str:
    if kind == "w":
        return wide(text)
    view = collapse(text, han=kind == "h")
    if kind == "j":
        rev = view.translate(_NO_NEWLINE_AHEAD)[::-1]
        view = _REVERSED_RUN.sub(lambda m: m.group().translate(_NEWLINE_AHEAD), rev)[::-1]
    return view


class PreTokenizer:
    """Cuts text into the words llama.cpp's ``unicode_regex_split`` gives for a regex list."""

    def __init__(self, regexes: tuple[str, ...]) -> None:
        # (view, compiled): view "c" = collapsed, "h" = collapsed with Han apart, "w" = wide
        self.steps: list[tuple[str, re.Pattern[str] | _Trailing | _DigitTriples | _DigitGroups]]
        self.steps = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "possible nested set" notes
            for rx in regexes:
                if rx == TRAILING_SPACE:
                    self.steps.append(("w", _Trailing()))
                    continue
                if rx == DIGIT_TRIPLES:
                    self.steps.append(("w", _DigitTriples()))
                    continue
                if rx in (AFMOE_DIGITS, AYA_DIGITS):
                    self.steps.append(("c", _DigitGroups()))
                    continue
                if rx == REGEXES["jais2"][0]:
                    step = ("j", _jais2(_rewrite(rx)))
                elif rx == KIMI:
                    step = ("h", KIMI_COLLAPSED)
                elif any(cat in rx for cat in _CATEGORY):
                    step = ("c", _rewrite(rx))
                else:
                    if "$" in rx.replace("\\$", ""):
                        raise ValueError(f"pre-tokenizer regex with an anchor: {rx!r}")
                    step = ("w", rx)
                self.steps.append((step[0], re.compile(step[1], re.ASCII)))

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        views: dict[str, str] = {}
        spans = [(0, len(text))]
        for kind, rx in self.steps:
            view = views.get(kind)
            if view is None:
                view = views[kind] = _view(text, kind)
            out: list[tuple[int, int]] = []
            add = out.append
            for start, end in spans:
                pos = start
                for m in rx.finditer(view, start, end):
                    s, e = m.span()
                    if s > pos:
                        add((pos, s))
                    if e > s:
                        add((s, e))
                    pos = e
                if pos < end:
                    add((pos, end))
            spans = out
        return [text[s:e] for s, e in spans]
