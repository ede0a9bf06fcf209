"""Token ids -> text, whole-sequence and streaming, as llama.cpp's ``llama_detokenize`` renders it
(``remove_special=False``): pieces are concatenated, the first piece loses one leading space
when the vocab adds a space prefix, and BPE vocabs with ``clean_spaces`` get llama.cpp's three
clean-up passes (`` ?``/`` !``/`` .``/`` ,``, `` ' ``, `` 's``/`` 'm``/`` 're``/`` 've``).

The streaming form must emit exactly what the whole-sequence form would, never half a UTF-8
character, and never text that a later token could still change; see ``_safe_cut``.
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mgserve.core.text.tokenizer import Tokenizer

_SPACE, _APOS = 0x20, 0x27
# llama.cpp runs three passes over the buffer, in place. Each pass reads only bytes it has not
# yet overwritten, except that pass 2 blanks the space after a " ' " it rewrote, so its matches
# cannot overlap; that is exactly what a left-to-right regex substitution does.
_PASSES = (
    (re.compile(rb" (?=[?!.,])"), b""),  # " ?", " !", " .", " ," lose the space
    (re.compile(rb" ' "), b"'"),  # " ' " -> "'"
    (re.compile(rb" '(?=[sm]|re|ve)"), b"'"),  # " 's", " 'm", " 're", " 've" lose the space
)


def clean_spaces(data: bytes) -> bytes:
    """llama.cpp's ``clean_spaces`` detokenizer passes (BPE vocabs other than qwen2 and kin)."""
    for pattern, repl in _PASSES:
        data = pattern.sub(repl, data)
    return data


def _safe_cut(buf: bytearray) -> int:
    """The largest p such that clean_spaces(buf) == clean_spaces(buf[:p]) + clean_spaces(buf[p:])
    for any continuation of buf: the passes decide about a byte from at most one byte before it
    and two after an apostrophe, so p is safe when buf[p-1] and buf[p] are neither space nor
    apostrophe and buf[p-2] is no apostrophe. 0 when there is none."""
    for p in range(len(buf) - 1, 0, -1):
        if buf[p] in (_SPACE, _APOS) or buf[p - 1] in (_SPACE, _APOS):
            continue
        if p >= 2 and buf[p - 2] == _APOS:
            continue
        return p
    return 0


def detokenize(tok: Tokenizer, ids: list[int], special: bool) -> str:
    parts = [tok.piece(t, special) for t in ids]
    if parts and tok.add_space_prefix and parts[0].startswith(b" "):
        parts[0] = parts[0][1:]
    data = b"".join(parts)
    if tok.clean_spaces:
        data = clean_spaces(data)
    return data.decode("utf-8", "replace")


class IncrementalDetokenizer:
    """Streaming detokenizer: ``"".join(push(t) for t in ids) + flush()`` equals
    ``tok.decode(ids, skip_special)`` (with the ``keep`` tokens rendered); a chunk never ends
    inside a UTF-8 character."""

    def __init__(
        self, tok: Tokenizer, skip_special: bool = True, keep: frozenset[int] = frozenset()
    ) -> None:
        self._tok = tok
        self._special = not skip_special
        self._keep = keep  # special tokens rendered even when skip_special
        self._first = True
        self._pending = bytearray()  # bytes a later token may still clean up (clean_spaces only)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        piece = self._tok.piece(token, self._special or token in self._keep)
        if self._first:
            self._first = False
            if self._tok.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
        if not self._tok.clean_spaces:
            return self._utf8.decode(piece)
        self._pending += piece
        cut = _safe_cut(self._pending)
        if cut == 0:
            return ""
        ready = clean_spaces(bytes(self._pending[:cut]))
        del self._pending[:cut]
        return self._utf8.decode(ready)

    def flush(self) -> str:
        ready = clean_spaces(bytes(self._pending))
        self._pending.clear()
        return self._utf8.decode(ready, final=True)
