"""``mgserve bench verify`` on the CPU (torch backend, tiny models): the cost table's rows, timed
as whole runner steps for a rewindable and a recurrent model, and forced acceptance giving plain
decode's tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mgserve.cli import main

ARGS = ["bench", "verify", "--device", "cpu", "--ctx", "256", "--slots", "2", "--depths", "0,40",
        "--drafts", "2,5", "--steps", "1", "--cache-type", "f16", "--ubatch", "32"]  # fmt: skip


def _export(arch: str, tmp_path: Path) -> Path:
    from tests.cuda.test_device_models import _export as export

    return export(arch, tmp_path)


def test_verify_rows_and_forced_acceptance(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _export("qwen3", tmp_path)
    assert main([*ARGS, "--model", str(path), "--forced", "3", "--forced-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "timed: whole runner steps" in out
    rows = re.findall(r"^\| (\d+) \| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out, re.M)
    assert rows == [("1", "2"), ("1", "5"), ("40", "2"), ("40", "5")]  # depth 0: decode at 1
    assert re.search(r"^\| 3 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| yes \|$", out, re.M)


def test_a_recurrent_model_verifies_through_the_runner_too(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Every device runner verifies drafts (rollback included), so a recurrent model's rows time
    whole runner steps and its forced acceptance gives plain decode's tokens."""
    path = _export("qwen3next", tmp_path)
    args = [*ARGS, "--model", str(path), "--depths", "8", "--drafts", "2"]
    assert main([*args, "--forced", "2", "--forced-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "timed: whole runner steps" in out
    assert re.findall(r"^\| (\d+) \| (\d+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", out, re.M) == [
        ("8", "2")
    ]
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| yes \|$", out, re.M)
