"""``mgserve bench invariance``: the command runs on the CPU (torch backend), prints its table,
records it, and fails (exit code 1) when a model's rows depend on the step's other rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.bench.invariance import lengths
from mgserve.cli import main

DATA = Path(__file__).resolve().parent.parent / "data"
LLAMA = str(DATA / "converted_llama.gguf")  # written by llama.cpp's converter
ARGS = ["bench", "invariance", "--model", LLAMA, "--device", "cpu", "--ctx", "512", "--ubatch",
        "128", "--lengths", "13..150", "--decode-steps", "3", "--cache-type", "f16"]  # fmt: skip


def test_lengths_spread_evenly_over_the_range() -> None:
    assert lengths("300..4000", 5) == [300, 1225, 2150, 3075, 4000]
    assert lengths("64", 1) == [64]
    with pytest.raises(ValueError, match="need 1 <= A <= B"):
        lengths("400..300", 5)


def test_the_command_reports_an_invariant_model_and_records_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*ARGS, "--record"]) == 0
    out = capsys.readouterr().out
    assert "5 prompts of 13, 47, 81, 115, 150 tokens" in out
    assert out.count("| equal | equal | 0 | 3/3 | 0 | none |") == 5
    assert "result: bitwise equal" in out
    recorded = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## batch invariance on the cpu (llama)" in recorded and "| 4 | 150 |" in recorded


def test_the_command_fails_when_a_row_depends_on_the_batch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mgserve.cuda.ops.norm import NormTorch

    rms = NormTorch.rms

    def batch_dependent(self: NormTorch, x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return rms(self, x, *args, **kw) + 1e-3 * x.shape[0]  # as if a tile were sized by the batch

    monkeypatch.setattr(NormTorch, "rms", batch_dependent)
    assert main(ARGS) == 1
    out = capsys.readouterr().out
    assert "| equal | differs |" in out and "| 0/3 |" in out
    assert "result: NOT batch-invariant" in out


def test_the_command_refuses_too_few_slots_or_too_short_a_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*ARGS, "--slots", "4"]) == 2
    assert "--slots 4 < --prompts 5" in capsys.readouterr().err
    assert main([*ARGS, "--ctx", "150"]) == 2
    assert "--ctx 150 < the longest prompt" in capsys.readouterr().err
