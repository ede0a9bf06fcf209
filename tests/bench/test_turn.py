"""``mgserve bench turn``: a conversation's next turn and an edited one, reusing the slot's cache
and its checkpoints vs cold, through the scheduler and the device runner on the CPU (torch
backend) and, marked, on a GPU; its rows, the refusal of bad sizes and the record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mgserve.cli import main

DATA = Path(__file__).resolve().parent.parent / "data"
# chunks end on multiples of 64 and 128, checkpoints on those of 128 and at the last chunk end
# before each prompt's end; two per slot on the device, the rest in host memory
ARGS = ["bench", "turn", "--ctx", "512", "--prompt", "300", "--generated", "4", "--user", "20",
        "--edit", "50", "--ubatch", "64", "--checkpoint-every", "128", "--ctx-checkpoints", "2",
        "--cache-type", "f16"]  # fmt: skip


def _rows(out: str) -> dict[str, tuple[int, int, int, float, str]]:
    rows = {}
    for name, cols in re.findall(r"^\| ((?:first|next|edited) turn[^|]*) \|(.*)\|$", out, re.M):
        n, cached, computed, ttft, up = (c.strip() for c in cols.split("|"))
        rows[name] = (int(n), int(cached), int(computed), float(ttft), up)
    return rows


def _check(out: str, edited: tuple[int, int, int] = (300, 128, 172)) -> None:
    rows = _rows(out)
    assert list(rows) == [
        "first turn, cold",
        "next turn, cold (reuse off)",
        "next turn, reused",
        "edited turn, reused",
    ]
    # (prompt, reused, computed): the next turn holds the first prompt and 4 generated tokens;
    # the slot holds all but the last generated one (never fed back), so 303 are reused; the
    # edited turn differs from 250 on: a recurrent slot's latest checkpoint at or before is at 128
    assert [r[:3] for r in rows.values()] == [(300, 0, 300), (324, 0, 324), (324, 303, 21), edited]
    for name, (*_, ttft, up) in rows.items():
        assert ttft > 0
        if name.endswith("reused"):
            assert float(up.rstrip("x")) > 0
    assert "- the next turn's first token reused and cold:" in out


def test_the_command_times_the_turns_and_records(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = str(DATA / "converted_qwen3next.gguf")
    assert main([*ARGS, "--model", model, "--device", "cpu", "--record"]) == 0
    out = capsys.readouterr().out
    _check(out)
    assert "checkpoints every 128, 2 per slot on the device, 8192 MiB host" in out
    recorded = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## next turn of a 300-token conversation: TTFT reused vs cold (qwen3next, cpu)" in (
        recorded
    )
    assert "| next turn, reused | 324 | 303 | 21 |" in recorded


def test_a_dense_model_rewinds_to_the_edit(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(DATA / "converted_llama.gguf")
    assert main([*ARGS, "--model", model, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    _check(out, edited=(300, 250, 50))  # its K/V rows cut back to the common prefix
    assert "checkpoints off" in out


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--slots", "1"], "--slots 1 < 2"),
        (["--edit", "300"], "--edit 300 must be below --prompt 300"),
        (["--user", "300"], "--prompt + --generated + --user must be in 2..511"),
    ],
)
def test_the_command_refuses_bad_sizes(
    capsys: pytest.CaptureFixture[str], extra: list[str], error: str
) -> None:
    model = str(DATA / "converted_llama.gguf")
    assert main([*ARGS, "--model", model, "--device", "cpu", *extra]) == 2
    assert error in capsys.readouterr().err


@pytest.mark.gpu
def test_the_command_on_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert main([*ARGS, "--model", str(DATA / "converted_qwen3next.gguf"), "--device", "cuda"]) == 0
    _check(capsys.readouterr().out)
