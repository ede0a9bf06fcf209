"""Code point classes exactly as llama.cpp's unicode.cpp sees them, and the "collapsed" text its
pre-tokenizer regexes run on.

llama.cpp does not run the ``\\p{L}``-style regexes on the text itself: it maps every code point
to one byte (ASCII stays, non-ASCII whitespace becomes ``\\x0b``, other non-ASCII code points
become one marker byte per category: number ``\\xd1``, letter ``\\xd2``, punctuation ``\\xd3``,
mark ``\\xd4``, symbol ``\\xd5``, anything else ``\\xd0``), rewrites each ``\\p{..}`` in the
regex as a class of its marker plus its ASCII members, and matches with an ASCII ``\\s``. Doing
the same here (one Python character per code point, so offsets carry over) gives the same words
for every regex, including the categories of code points newer than Python's Unicode data.
"""

from __future__ import annotations

import base64
import zlib
from functools import cache

import numpy as np

from mgserve.core.text import unicode_data as _data

UNDEFINED = 0x0001
NUMBER = 0x0002
LETTER = 0x0004
SEPARATOR = 0x0008
MARK = 0x0010
PUNCTUATION = 0x0020
SYMBOL = 0x0040
CONTROL = 0x0080
WHITESPACE = 0x0100
N_CODEPOINTS = 0x110000
C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale, which llama.cpp's C++ code calls

# category bit -> marker byte in the collapsed text (unicode.cpp's k_ucat_cpt)
MARKERS = {NUMBER: 0xD1, LETTER: 0xD2, PUNCTUATION: 0xD3, MARK: 0xD4, SYMBOL: 0xD5}
OTHER_MARKER = 0xD0
HAN_MARKER = 0xD6  # our own: Kimi-K2's pre-tokenizer tells Han letters from other letters
# Han ranges as unicode_cpt_is_han lists them: CJK unified ideographs and extensions A-F,
# compatibility ideographs and their supplement
_HAN = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)  # fmt: skip


def _unpack(blob: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(blob)), dtype="<u4").astype(np.int64)


@cache
def flags() -> np.ndarray:
    """uint16 flags per code point (unicode_cpt_flags_from_cpt, whitespace bit included)."""
    pairs = _unpack(_data.FLAG_RANGES).reshape(-1, 2)
    out = np.zeros(N_CODEPOINTS, dtype=np.uint16)
    for (start, value), (end, _) in zip(pairs[:-1], pairs[1:], strict=True):
        out[start:end] = value
    out[_unpack(_data.WHITESPACE)] |= WHITESPACE
    return out


@cache
def _collapse_table(han: bool) -> np.ndarray:
    f = flags()
    table = np.full(N_CODEPOINTS, OTHER_MARKER, dtype=np.uint8)
    category = f & 0xFF
    for bit, marker in MARKERS.items():
        table[category == bit] = marker
    if han:
        for lo, hi in _HAN:
            table[lo : hi + 1] = HAN_MARKER
    table[(f & WHITESPACE) != 0] = 0x0B
    table[:128] = np.arange(128, dtype=np.uint8)
    return table


@cache
def _wide_table() -> np.ndarray:
    """Code point -> itself, except non-ASCII whitespace -> 0x0b (what std::wregex sees)."""
    table = np.arange(N_CODEPOINTS, dtype=np.uint32)
    ws = (flags() & WHITESPACE) != 0
    ws[:128] = False
    table[ws] = 0x0B
    return table


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def collapse(text: str, han: bool = False) -> str:
    """One character per code point: the text llama.cpp matches ``\\p{..}`` regexes against."""
    if text.isascii():
        return text
    return _collapse_table(han)[_codepoints(text)].tobytes().decode("latin-1")


def wide(text: str) -> str:
    """The text llama.cpp matches regexes without ``\\p{..}`` against (std::wregex)."""
    if text.isascii():
        return text
    cps = _codepoints(text)
    if not (_wide_table()[cps] != cps).any():
        return text
    return _wide_table()[cps].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


@cache
def _lower_map() -> dict[int, int]:
    pairs = _unpack(_data.LOWERCASE).reshape(-1, 2)
    return {int(a): int(b) for a, b in pairs}


def tolower(cp: int) -> int:
    """unicode_tolower: the simple lowercase mapping of llama.cpp's table."""
    return _lower_map().get(cp, cp)


@cache
def _nfd_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    triples = _unpack(_data.NFD).reshape(-1, 3)
    return triples[:, 0], triples[:, 1], triples[:, 2]


def nfd_base(cp: int) -> int:
    """unicode_cpts_normalize_nfd for one code point: the base of its decomposition."""
    first, last, base = _nfd_table()
    i = int(np.searchsorted(first, cp, side="right")) - 1
    if i >= 0 and first[i] <= cp <= last[i]:
        return int(base[i])
    return cp
