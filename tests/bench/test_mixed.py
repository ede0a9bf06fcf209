"""``mgserve bench mixed``: decoders beside a long prefill through the scheduler and the device
runner, on the CPU (torch backend) and, marked, on a GPU; its rows (the prefill lane's too), the
refusal of too few slots and the record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mgserve.cli import main

DATA = Path(__file__).resolve().parent.parent / "data"
ARGS = ["bench", "mixed", "--ctx", "512", "--slots", "3", "--depth", "100", "--prompt", "300",
        "--ubatch", "128", "--decode-steps", "3", "--itl-target-ms", "2x,40",
        "--cache-type", "f16", "--prefill-lane"]  # fmt: skip


def _check(out: str) -> None:
    rows = dict(re.findall(r"^\| (decode alone|prefill alone|mixed[^|]*) \|(.*)$", out, re.M))
    assert list(rows) == [
        "decode alone",
        "prefill alone",
        "mixed, no target",
        *(k for k in rows if k.startswith("mixed, --itl-target-ms") and k.endswith("(2x)")),
        "mixed, --itl-target-ms 40.0 (40)",
        "mixed, --prefill-lane on",
    ]
    for name, cols in rows.items():
        itl_p50, itl_p99, _, rate, share = (c.strip() for c in cols.split("|")[:5])
        if name != "prefill alone":
            assert 0 < float(itl_p50) <= float(itl_p99)
        if name != "decode alone":
            assert float(rate) > 0
        if name.startswith("mixed"):
            assert share.endswith("%")


def test_the_command_runs_every_load_side_by_side_and_records(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = str(DATA / "converted_qwen3next.gguf")
    assert main([*ARGS, "--model", model, "--device", "cpu", "--record"]) == 0
    out = capsys.readouterr().out
    _check(out)
    assert "2 sessions decoding at depth 100 (synthetic state) beside a 300-token prompt" in out
    recorded = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## mixed load: decoders at depth 100 beside a 300-token prompt (qwen3next, cpu)" in (
        recorded
    )
    assert "| mixed, no target |" in recorded


def test_the_command_wants_a_slot_for_the_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(DATA / "converted_llama.gguf")
    assert main([*ARGS, "--model", model, "--device", "cpu", "--slots", "2"]) == 2
    assert "--slots 2 < --decoders 2 + 1" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_command_on_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert main([*ARGS, "--model", str(DATA / "converted_qwen3next.gguf"), "--device", "cuda"]) == 0
    _check(capsys.readouterr().out)
