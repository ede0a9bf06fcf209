"""Special tokens as llama.cpp's llama-vocab.cpp treats them: token attributes, the
end-of-generation set, and the split of input text around special-token texts
(``tokenizer_st_partition``).

llama.cpp knows several special tokens only by their text (``<end_of_turn>``, ``<|im_end|>``...)
and upgrades them to control tokens; the rules below repeat that, so ``eog_ids`` and
``is_control`` agree with llama.cpp for the same GGUF.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mgserve.core.text.unicode import C_SPACE

# llama_token_attr bits (llama.h)
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

# GGUF tokenizer.ggml.token_type values -> attribute bits; anything else is "undefined" (0)
_TYPE_TO_ATTR = {
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

# Token texts that end generation (llama-vocab.cpp, "maintain a list of tokens that cause EOG").
EOG_TEXTS = frozenset(
    [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    ]
)  # fmt: skip
# roles whose token also ends generation
_EOG_ROLES = ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def token_attrs(meta: Mapping[str, Any], n_vocab: int) -> np.ndarray:
    """Attribute bits per token from ``tokenizer.ggml.token_type`` (all normal when absent)."""
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return np.full(n_vocab, ATTR_NORMAL, dtype=np.int32)
    types = np.asarray(types, dtype=np.int64)[:n_vocab]
    if len(types) < n_vocab:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries, need {n_vocab}")
    lut = np.zeros(8, dtype=np.int32)
    for ty, attr in _TYPE_TO_ATTR.items():
        lut[ty] = attr
    return lut[np.clip(types, 0, 7)]


def derive_eog(
    token_to_id: Mapping[str, int], attrs: np.ndarray, eos: int | None, roles: Mapping[str, int]
) -> frozenset[int]:
    """End-of-generation ids as llama.cpp derives them (``roles``: roles.special_roles'); updates
    ``attrs`` in place the same way (EOG texts become control; a few model-family fix-ups)."""
    texts = {token_to_id[t]: t for t in EOG_TEXTS if t in token_to_id}
    for tid in texts:
        attrs[tid] |= ATTR_CONTROL
    eog = set(texts) | {roles[r] for r in _EOG_ROLES if r in roles}
    if eos is not None:
        eog.add(eos)
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss
        if text in token_to_id:
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    by_text = {t: i for i, t in texts.items()}
    # o200k_harmony / solar-open: "<|end|>" is not a stop there
    has_call = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
        eog.discard(by_text["<|end|>"])
        attrs[by_text["<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 / plamo: "</s>" is a normal token there
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in token_to_id):
        eog.discard(by_text["</s>"])
        attrs[by_text["</s>"]] = ATTR_NORMAL
    return frozenset(eog)


def mark_unused(tokens: Sequence[str], attrs: np.ndarray) -> None:
    """Control tokens whose text contains "unused" get the unused bit (llama.cpp does this)."""
    for tid in np.flatnonzero(attrs & ATTR_CONTROL).tolist():
        if "unused" in tokens[tid]:
            attrs[tid] |= ATTR_UNUSED


def strip_rules(
    meta: Mapping[str, Any], token_to_id: Mapping[str, int], attrs: Sequence[int]
) -> tuple[frozenset[int], frozenset[int]]:
    """Ids whose neighbouring whitespace llama.cpp strips when it splits them out of the text
    (LSTRIP: before the token, RSTRIP: after it), set by model or pre-tokenizer name."""
    name = str(meta.get("general.name", "")).lower()
    pre = str(meta.get("tokenizer.ggml.pre", ""))
    arch = str(meta.get("general.architecture", ""))
    lstrip: set[int] = set()
    rstrip: set[int] = set()
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in token_to_id:
            lstrip.add(token_to_id["<mask>"])
    elif "phi-3" in name or "phi3" in name:
        special = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        rstrip.update(i for i, a in enumerate(attrs) if a & special)
        if "</s>" in token_to_id:
            rstrip.add(token_to_id["</s>"])
        rstrip.difference_update(token_to_id.get(t) for t in ("<unk>", "<s>", "<|endoftext|>"))
    elif "modern-bert" in name and "[MASK]" in token_to_id:
        lstrip.add(token_to_id["[MASK]"])
    return frozenset(lstrip), frozenset(rstrip)


class SpecialSplitter:
    """Cuts text into raw-text pieces and special-token ids, exactly like llama.cpp's
    ``tokenizer_st_partition``: special tokens are taken one at a time, longest text first, and
    each claims its leftmost non-overlapping occurrences in the text that is still raw.

    Only the specials that occur in the text matter, and finding them one by one over a 262k
    vocab would scan the text thousands of times; one regex trie finds, at every position, the
    longest special starting there, and every special that is a prefix of a found one is added.
    """

    def __init__(
        self,
        specials: Sequence[tuple[str, int]],
        lstrip: frozenset[int] = frozenset(),
        rstrip: frozenset[int] = frozenset(),
    ) -> None:
        self.lstrip, self.rstrip = lstrip, rstrip
        # llama.cpp sorts by byte length, longest first (std::sort: ties in unspecified order;
        # we break them by id)
        self.specials = sorted(specials, key=lambda s: (-len(s[0].encode()), s[1]))
        self.rank = {text: i for i, (text, _) in enumerate(self.specials)}
        self.prefixes: dict[str, list[str]] = {}
        texts = set(self.rank)
        for text in texts:
            self.prefixes[text] = [text[:k] for k in range(1, len(text)) if text[:k] in texts]
        self.finder = re.compile("(?=(" + trie_regex(texts) + "))") if texts else None

    def split(self, text: str) -> list[str | int]:
        if self.finder is None or not text:
            return [text] if text else []
        present: set[str] = set()
        for found in set(self.finder.findall(text)):
            present.add(found)
            present.update(self.prefixes[found])
        if not present:
            return [text]
        claimed = bytearray(len(text))  # 1 where a special already took the character
        starts: dict[int, tuple[int, int]] = {}  # start -> (end, id)
        for stext, sid in sorted((self.specials[self.rank[t]] for t in present), key=self._key):
            n = len(stext)
            last_end = 0
            pos = text.find(stext)
            while pos >= 0:
                if pos < last_end:  # overlaps this special's previous occurrence
                    pos = text.find(stext, last_end)
                    continue
                taken = claimed.find(1, pos, pos + n)
                if taken >= 0:  # every start up to the end of that claimed run overlaps it
                    free = claimed.find(0, taken)
                    pos = text.find(stext, free) if free >= 0 else -1
                    continue
                claimed[pos : pos + n] = b"\x01" * n
                starts[pos] = (pos + n, sid)
                last_end = pos + n
                pos = text.find(stext, last_end)
        out: list[str | int] = []
        cur = 0
        for start in sorted(starts):
            end, sid = starts[start]
            if start > cur:
                out.append(text[cur:start])
            out.append(sid)
            cur = end
        if cur < len(text):
            out.append(text[cur:])
        if self.lstrip or self.rstrip:
            out = self._strip(out)
        return out

    def _strip(self, parts: list[str | int]) -> list[str | int]:
        """Whitespace next to LSTRIP / RSTRIP tokens goes (tokenizer_st_partition)."""
        out: list[str | int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                if i > 0 and parts[i - 1] in self.rstrip:
                    part = part.lstrip(C_SPACE)
                if i + 1 < len(parts) and parts[i + 1] in self.lstrip:
                    part = part.rstrip(C_SPACE)
                if not part:
                    continue
            out.append(part)
        return out

    def _key(self, special: tuple[str, int]) -> int:
        return self.rank[special[0]]


def trie_regex(words: set[str]) -> str:
    """A regex matching any of ``words``, longest alternative first, shaped as a trie so that
    matching costs one pass over the candidate characters, not one try per word."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)
