"""The tokenizer stored in a GGUF file's metadata, giving the same ids and text as llama.cpp.

Supported vocab types: SentencePiece-style (``tokenizer.ggml.model == "llama"``, Gemma 3,
Llama 2; see spm.py), BPE (``"gpt2"``: byte-level, Qwen, Llama 3, SmolLM, every
``tokenizer.ggml.pre`` llama.cpp knows; ``"gemma4"``: raw UTF-8 with ``▁`` for spaces;
bpe.py, pretok.py, pretok_types.py) and WordPiece (``"bert"``; wpm.py).
Special tokens, bos/eos handling, the end-of-generation set and the fill-in-the-middle tokens
follow llama-vocab.cpp (special.py, roles.py); text comes back through detokenizer.py.

    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    ids = tok.encode("<start_of_turn>user\\nHi", parse_special=True)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any

import numpy as np

from mgserve.core.text.bpe import BpeEncoder, decode_text
from mgserve.core.text.detokenizer import IncrementalDetokenizer, detokenize
from mgserve.core.text.pretok_types import PRE_TYPES, PreType
from mgserve.core.text.roles import FimTokens, special_roles
from mgserve.core.text.special import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    SpecialSplitter,
    derive_eog,
    mark_unused,
    strip_rules,
    token_attrs,
)
from mgserve.core.text.spm import SPACE, SpmEncoder
from mgserve.core.text.wpm import WpmEncoder

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

_MODELS = {
    "llama": "SentencePiece",
    "gpt2": "byte-level BPE",
    "gemma4": "BPE over raw UTF-8",
    "bert": "WordPiece",
}
_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN  # hidden by piece(special=False), not split without parse
_RAW = _SPECIAL | ATTR_USER_DEFINED  # rendered as their plain text


class Tokenizer:
    """Build with ``from_metadata``; every id-taking method raises ValueError for a bad id."""

    def __init__(self, meta: Mapping[str, Any]) -> None:
        model = meta.get("tokenizer.ggml.model")
        if model not in _MODELS:
            raise ValueError(
                f"unsupported tokenizer: tokenizer.ggml.model = {model!r} (supported: "
                + ", ".join(f"{k!r} ({v})" for k, v in _MODELS.items())
                + "; mgserve serves no architecture that uses the others)"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        self.model: str = model
        self._tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.n_vocab: int = len(self._tokens)
        self._to_id: dict[str, int] = dict(zip(self._tokens, range(self.n_vocab), strict=True))
        attrs = token_attrs(meta, self.n_vocab)

        spm = model == "llama"
        self.escape_whitespaces = False
        self.sep_id: int | None = None
        self._encoder: SpmEncoder | BpeEncoder | WpmEncoder
        pre_type: PreType | None = None
        default_bos: int | None
        default_eos: int | None
        if model == "bert":
            self.add_bos, self.add_eos, self.clean_spaces = True, False, True
            lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
            strip = bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
            unk = self._special_id(meta, "unknown", 100)
            self._encoder = WpmEncoder(self._to_id, unk, lowercase, strip)
            self.sep_id = self._special_id(meta, "seperator", 102)  # sic, llama.cpp's key
            default_bos, default_eos = 101, None
        elif spm:
            self.add_bos, self.add_eos, self.clean_spaces = True, False, False
            scores = meta.get("tokenizer.ggml.scores")
            scores = [0.0] * self.n_vocab if scores is None else np.asarray(scores).tolist()
            if len(scores) < self.n_vocab:
                raise ValueError(
                    f"tokenizer.ggml.scores has {len(scores)} entries, need {self.n_vocab}"
                )
            self._encoder = SpmEncoder(self._tokens, self._to_id, scores)
            default_bos, default_eos = 1, 2
        else:
            # gemma4 vocabs are BPE whose pre-tokenizer is always "gemma4"
            pre = "gemma4" if model == "gemma4" else meta.get("tokenizer.ggml.pre") or "default"
            if pre not in PRE_TYPES:
                raise ValueError(
                    f"unsupported pre-tokenizer: tokenizer.ggml.pre = {pre!r} "
                    f"(supported: {', '.join(sorted(PRE_TYPES))})"
                )
            pre_type = PRE_TYPES[pre]
            self.add_bos, self.clean_spaces = pre_type.add_bos, pre_type.clean_spaces
            self.escape_whitespaces = pre_type.escape_whitespaces
            self.add_eos = False
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None and pre != "kimi-k2":  # llama.cpp lets Kimi-K2 go without
                raise ValueError("BPE tokenizer without tokenizer.ggml.merges")
            self._encoder = BpeEncoder(pre_type, self._to_id, merges or [])
            default_bos, default_eos = (None, None) if model == "gemma4" else (11, 11)
            if pre_type.no_bos:
                default_bos = None
        self.add_space_prefix: bool = bool(meta.get("tokenizer.ggml.add_space_prefix", spm))
        self._spm_like = spm or model == "bert"  # pieces: "▁" is a space
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", self.add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", self.add_eos))
        if pre_type is not None and pre_type.force_bos:
            self.add_bos = True
        self.bos_id: int | None = self._special_id(meta, "bos", default_bos)
        self.eos_id: int | None = self._special_id(meta, "eos", default_eos)
        roles = special_roles(meta, self._to_id, attrs)
        self.eog_ids: frozenset[int] = derive_eog(self._to_id, attrs, self.eos_id, roles)
        self.fim: FimTokens = FimTokens.from_roles(roles)  # what /infill builds prompts from
        mark_unused(self._tokens, attrs)
        self._attrs: list[int] = attrs.tolist()
        self._lstrip, self._rstrip = strip_rules(meta, self._to_id, self._attrs)
        self._pieces: list[list[bytes | None]] = [[None] * self.n_vocab, [None] * self.n_vocab]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        return cls(meta)

    def _special_id(self, meta: Mapping[str, Any], name: str, default: int | None) -> int | None:
        if default is not None and default >= self.n_vocab:
            default = None
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is None or not 0 <= int(value) < self.n_vocab:
            return default  # llama.cpp warns about an out-of-range id and keeps the default
        return int(value)

    # ---- encoding

    @cached_property
    def _split_parse(self) -> SpecialSplitter:
        return SpecialSplitter(
            [(t, i) for i, t in enumerate(self._tokens) if self._attrs[i] & _RAW],
            self._lstrip,
            self._rstrip,
        )

    @cached_property
    def _split_plain(self) -> SpecialSplitter:
        # without parse_special, user-defined tokens are still split out first (llama.cpp,
        # after huggingface tokenizers); control and unknown ones are plain text
        return SpecialSplitter(
            [
                (t, i)
                for i, t in enumerate(self._tokens)
                if self._attrs[i] & _RAW and not self._attrs[i] & _SPECIAL
            ],
            self._lstrip,
            self._rstrip,
        )

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """``llama_tokenize(text, add_special, parse_special)``."""
        fragments = (self._split_parse if parse_special else self._split_plain).split(text)
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise ValueError("the vocab asks for a BOS token but has none")
            out.append(self.bos_id)
        prev_special = True  # SPM: a fragment at the start or after a special gets the prefix
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            if self.escape_whitespaces:
                frag = frag.replace(" ", SPACE)
            self._encoder.encode(frag, out)
            prev_special = False
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise ValueError("the vocab asks for an EOS token but has none")
            out.append(self.eos_id)
        if add_special and self.model == "bert":  # WordPiece always ends with the separator
            if self.sep_id is None:
                raise ValueError("the WordPiece vocab has no separator token")
            out.append(self.sep_id)
        return out

    # ---- decoding

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Whole-sequence text (``llama_detokenize``, unparse_special = not skip_special);
        invalid UTF-8 becomes U+FFFD."""
        return detokenize(self, list(ids), not skip_special)

    def piece(self, token: int, special: bool = True) -> bytes:
        """``llama_token_to_piece`` bytes; with special=False control tokens render as b""."""
        self._check(token)
        cache = self._pieces[special]
        p = cache[token]
        if p is None:
            p = cache[token] = self._render(token, special)
        return p

    def _render(self, token: int, special: bool) -> bytes:
        attr = self._attrs[token]
        text = self._tokens[token]
        if attr & _SPECIAL and not special:
            return b""
        if attr & _RAW:
            return text.encode()
        if attr & ATTR_NORMAL:
            if self._spm_like or self.escape_whitespaces:
                return text.replace(SPACE, " ").encode()
            return decode_text(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens render as nothing

    # ---- vocab lookups

    def token_text(self, token: int) -> str:
        self._check(token)
        return self._tokens[token]

    def attr(self, token: int) -> int:
        """llama.cpp's attribute bits of the token (special.ATTR_*)."""
        self._check(token)
        return self._attrs[token]

    def is_control(self, token: int) -> bool:
        self._check(token)
        return bool(self._attrs[token] & ATTR_CONTROL)

    def token_id(self, text: str) -> int | None:
        return self._to_id.get(text)

    def _check(self, token: int) -> None:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} out of range [0, {self.n_vocab})")
