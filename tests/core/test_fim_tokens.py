"""Fill-in-the-middle tokens found as llama.cpp finds them (mgserve/core/text/roles.py): against
llama.cpp's own answer for every vocab it ships and Qwen2.5-Coder's (recorded by
tests/data/make_fim_reference.py), then the key rules on hand-made metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mgserve.core.synth.vocab import SynthVocab
from mgserve.core.text.roles import FimTokens
from mgserve.core.text.tokenizer import Tokenizer
from tests.core import coder_vocab
from tests.core.test_tokenizer_llama_vectors import metadata

REF = json.loads((Path(__file__).parent.parent / "data" / "llama_vocab" / "fim.json").read_text())


def _meta(name: str) -> dict[str, Any]:
    return coder_vocab.coder_metadata() if name == "qwen2.5-coder" else metadata(name)


@pytest.mark.parametrize("name", sorted(REF))
def test_fim_ids_and_eog_match_llama_cpp(name: str) -> None:
    tok = Tokenizer.from_metadata(_meta(name))
    want = {role: (None if tid < 0 else tid) for role, tid in REF[name]["fim"].items()}
    assert tok.fim._asdict() == want
    assert sorted(tok.eog_ids) == REF[name]["eog"]


def test_qwen25_coder_tokens_as_its_file_has_them() -> None:
    tok = Tokenizer.from_metadata(coder_vocab.coder_metadata())
    assert tok.fim == FimTokens(151659, 151661, 151660, 151662, 151663, 151664)
    assert tok.token_text(151659) == "<|fim_prefix|>" and tok.token_text(151664) == "<|file_sep|>"
    assert all(tok.is_control(t) for t in tok.fim)
    assert {tok.fim.pad, tok.fim.rep, tok.fim.sep} <= tok.eog_ids  # they end a middle
    assert tok.fim.missing() == []
    # FIM texts in code are code unless special tokens are parsed
    assert tok.fim.pre not in tok.encode("<|fim_prefix|>", add_special=False)
    assert tok.encode("<|fim_prefix|>", add_special=False, parse_special=True) == [tok.fim.pre]


def _small(tokens: dict[int, tuple[str, int]], **keys: int) -> dict[str, Any]:
    """A 320-token synthetic BPE vocab with ``tokens`` {id: (text, GGUF type)} put in, and
    ``tokenizer.ggml.<name>_token_id`` keys."""
    meta = {k: v for k, (v, _) in SynthVocab(320, "qwen2", 300, 301, 302).metadata().items()}
    for tid, (text, ty) in tokens.items():
        meta["tokenizer.ggml.tokens"][tid] = text
        meta["tokenizer.ggml.token_type"][tid] = ty
    meta |= {f"tokenizer.ggml.{k}_token_id": v for k, v in keys.items()}
    return meta


NORMAL = 1
STARCODER = {310: ("<fim_prefix>", NORMAL), 311: ("<fim_suffix>", NORMAL), 312: ("<fim_middle>", 3)}


def test_found_by_text_become_control() -> None:
    tok = Tokenizer.from_metadata(_small(STARCODER))
    assert tok.fim == FimTokens(pre=310, suf=311, mid=312)
    assert tok.is_control(310) and tok.is_control(311)
    assert tok.fim.rep is None and tok.fim.sep is None


def test_keys_win_over_texts_and_deprecated_keys_over_new_ones() -> None:
    tok = Tokenizer.from_metadata(_small(STARCODER, fim_pre=313, fim_mid=314, middle=315))
    assert (tok.fim.pre, tok.fim.suf, tok.fim.mid) == (313, 311, 315)
    assert not tok.is_control(313)  # a keyed token keeps its type, as in llama.cpp
    # an id outside the vocab counts as no key: the text decides
    tok = Tokenizer.from_metadata(_small(STARCODER, fim_pre=9999, prefix=320))
    assert tok.fim.pre == 310


def test_missing_roles_are_named() -> None:
    tok = Tokenizer.from_metadata(_small({310: ("<fim_prefix>", 3)}))
    assert tok.fim.missing() == ["suffix", "middle"]
