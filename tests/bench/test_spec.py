"""``mgserve bench spec`` on the built-in Gemma 3 270M on the CPU, through the whole server: the
rewrite workload with speculation off and on gives the same text (the exit status says so) while
drafts were proposed and verified, and the table and the output follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mgserve.cli import main

pytestmark = pytest.mark.slow


def test_rewrite_on_and_off_give_the_same_text(
    gemma_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["bench", "spec", "--model", str(gemma_path), "--device", "cpu", "--ctx", "1024"]
    args += ["--workloads", "rewrite", "--users", "1", "--max-tokens", "24", "--repeat", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    row = re.search(r"^\| rewrite \| 1 \| on \|([^\n]*)\| yes \|$", out, re.M)
    assert row, out
    cols = [c.strip() for c in row.group(1).split("|")]
    proposed, accepted = int(cols[3]), int(cols[4])
    assert proposed > 0 and 0 <= accepted <= proposed  # drafts were verified, text unchanged
    assert "--- rewrite: " in out
