"""The roles special tokens play (end of turn, end of message, fill-in-the-middle), found as
llama.cpp's llama-vocab.cpp finds them: from their ``tokenizer.ggml.*_token_id`` key, else by
their text (``<|fim_prefix|>``, ``<fim_prefix>``, ``<PRE>``...), since converters write no key for
most of them (Qwen2.5-Coder's files have none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from mgserve.core.text.special import ATTR_CONTROL

# Role ids llama.cpp takes from their key, else finds by text; the token found becomes control.
# (llama.cpp takes the first hit in hash-map order; we mark every hit, which only differs for a
# vocab holding two candidates for the same role.)
_DETECTED: dict[str, tuple[str, ...]] = {
    "eot": (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
# keys older files use for three FIM roles; llama.cpp reads them after the new ones, so they win
_DEPRECATED = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}


class FimTokens(NamedTuple):
    """The vocab's fill-in-the-middle token ids (None: it has none for that role)."""

    pre: int | None = None  # starts the code before the cursor
    suf: int | None = None  # starts the code after the cursor
    mid: int | None = None  # the model writes the middle after it
    pad: int | None = None
    rep: int | None = None  # starts a repository's name (repo-level prompts)
    sep: int | None = None  # starts a file (its name, then its text)

    @classmethod
    def from_roles(cls, roles: Mapping[str, int]) -> FimTokens:
        """From ``special_roles``' answer."""
        return cls(*(roles.get(f"fim_{f}") for f in cls._fields))

    def missing(self) -> list[str]:
        """The roles an infill prompt needs (prefix, suffix, middle) that the vocab lacks."""
        need = {"prefix": self.pre, "suffix": self.suf, "middle": self.mid}
        return [name for name, tid in need.items() if tid is None]


def _key_id(meta: Mapping[str, Any], role: str, n_vocab: int) -> int | None:
    """The role's id from the GGUF keys (an out-of-range id counts as absent)."""
    found = None
    for name in (role, _DEPRECATED.get(role)):
        tid = meta.get(f"tokenizer.ggml.{name}_token_id") if name else None
        if tid is not None and 0 <= int(tid) < n_vocab:
            found = int(tid)
    return found


def special_roles(
    meta: Mapping[str, Any], token_to_id: Mapping[str, int], attrs: np.ndarray
) -> dict[str, int]:
    """The eot, eom and FIM roles' ids as llama.cpp finds them (key, else text); updates ``attrs``
    in place the same way (a token found by text becomes control)."""
    roles: dict[str, int] = {}
    for role, candidates in _DETECTED.items():
        tid = _key_id(meta, role, len(attrs))
        if tid is not None:
            roles[role] = tid
            continue
        hits = [token_to_id[t] for t in candidates if t in token_to_id]
        for hit in hits:
            attrs[hit] |= ATTR_CONTROL
        if hits:
            roles[role] = hits[0]
    return roles
