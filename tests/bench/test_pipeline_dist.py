"""``mgserve bench pipeline-dist`` on the CPU: two processes of a pipeline (gloo) against one, a
tiny model; both give the same greedy tokens (the bench fails otherwise) and the table is
recorded. A GPU run without a GPU per rank is refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgserve.cli import main
from tests.api.serve_process import ROOT

pytestmark = pytest.mark.slow
MODEL = str(ROOT / "tests" / "data" / "converted_llama.gguf")


def test_two_processes_against_one(tmp_path: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    args = ["bench", "pipeline-dist", "--model", MODEL, "--prompt", "48", "--ubatch", "16",
            "--sessions", "2", "--decode-steps", "3", "--decode-depth", "5",
            "--runs", "1x1,2x1,2x1m2", "-ts", "1,1"]  # fmt: skip
    assert main([*args, "--record"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| ") and "process" in r]
    assert len(rows) == 3 and all(r.rstrip().endswith("| yes |") for r in rows), out
    assert "| 2 process(es) x 1 thread(s) | 0-0 / 1-1 |" in out  # -ts 1,1 of 2 layers
    # each run's stages: busy fractions and overlap, prefill; decode (pipeline/stage_stats.py)
    for n, row in zip((1, 2, 2), rows, strict=True):
        cells = row.split(" | ")
        for phase in cells[-3].split("; "):
            fractions, overlap = phase.split(", overlap ")
            busy = [float(f) for f in fractions.split(" / ")]
            assert len(busy) == n and all(0 < b <= 1 for b in busy), row
            assert 0 < float(overlap) <= n + 1e-9, row
        # the pipeline model from the run's stage times: at least the run's speed (links free)
        tps, step_ms = (float(x) for x in cells[-2].split(" / "))
        assert tps >= 0.9 * float(cells[2]) and 0 < step_ms <= 1.1 * float(cells[5]), row
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## layer pipeline across processes (torch.distributed)" in text
    monkeypatch.setattr("mgserve.machine.gpu_ids", lambda: ["GPU-a"])
    assert main([*args[:-4], "--runs", "2x1", "--device", "cuda"]) == 2
    assert "NCCL needs a GPU per rank and 1 are here" in capsys.readouterr().err
