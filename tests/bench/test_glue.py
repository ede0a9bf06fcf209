"""``mgserve bench glue``: the torch ops a device model's decode step runs between op families."""

from __future__ import annotations

from pathlib import Path

from mgserve.bench.glue import decode_glue, launches
from mgserve.cli import main

DATA = Path(__file__).resolve().parent.parent / "data"
QWEN4EXP = str(DATA / "converted_qwen4exp.gguf")  # written by llama.cpp's converter


def test_family_calls_are_not_counted_and_the_glue_is() -> None:
    everything = launches(decode_glue(QWEN4EXP, families=False))
    glue = launches(decode_glue(QWEN4EXP))
    # the projections, norms and attention run inside families: matrix products are not glue
    assert sum(everything[k] for k in ("mm", "addmm", "bmm")) > 0
    assert not {"mm", "addmm", "bmm"} & set(glue)
    assert sum(glue.values()) < sum(everything.values())
    # what the model still computes itself (issue 10: fuse into families until this is empty):
    # e.g. the shared expert's sigmoid gate, DeltaNet's softplus decay and its bias add
    assert {"sigmoid", "softplus", "add"} <= set(glue)


def test_the_command_prints_the_table(capsys) -> None:
    assert main(["bench", "glue", "--model", QWEN4EXP, "--sessions", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch ops outside the op families that run a kernel" in out
    assert "| sigmoid |" in out and "| view |" not in out
