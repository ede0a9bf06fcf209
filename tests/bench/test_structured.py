"""``mgserve bench structured``: decode free and under a JSON schema through the device runner, on
the CPU (torch backend) and, marked, on a GPU; its table, notes and the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mgserve.bench.structured import schema
from mgserve.cli import main

LLAMA = str(Path(__file__).resolve().parent.parent / "data" / "converted_llama.gguf")
ARGS = ["bench", "structured", "--model", LLAMA, "--sessions", "1,2", "--steps", "4",
        "--warmup", "1", "--ctx", "256", "--ubatch", "64"]  # fmt: skip


def test_the_schema_cannot_end_within_the_run() -> None:
    s = schema(136)
    assert s["type"] == "array" and s["minItems"] == 35
    shortest = [{"name": "", "city": "", "note": ""}] * s["minItems"]
    assert len(json.dumps(shortest)) > 4 * 136  # even at 4 bytes a token, more than 136 tokens


def _check(out: str) -> None:
    for n in (1, 2):
        assert f"| {n} | none |" in out and f"| {n} | JSON schema |" in out
        # 1 + 5 tokens of a byte-level vocabulary: the schema's first bytes
        assert f"- {n} session(s), session 0 under the schema: '[{{\"nam'" in out
    assert "llguidance" in out


def test_the_command_decodes_free_and_under_the_schema_and_records(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*ARGS, "--device", "cpu", "--record"]) == 0
    out = capsys.readouterr().out
    _check(out)
    assert "the CPU backend is synchronous" in out
    recorded = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## structured output: decode with and without a JSON schema (cpu)" in recorded
    assert "| 2 | JSON schema |" in recorded


def test_the_command_refuses_more_sessions_than_slots(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--device", "cpu", "--slots", "1"]) == 2
    assert "--slots 1 < --sessions 2" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_command_on_the_gpu_keeps_graphs_and_reports_the_overlap(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert main([*ARGS, "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    _check(out)
    assert "decode graphs captured for batch sizes (1, 2)" in out
    assert "overlap the GPU's forward" in out
