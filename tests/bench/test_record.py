"""What a benchmark's record says of the machine: the host, and the GPU where one ran it (the
H100 runs of 2026-12-05 were recorded with the CPU's name only)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mgserve import bench


def _torch(available: bool) -> SimpleNamespace:
    cuda = SimpleNamespace(is_available=lambda: available, get_device_name=lambda i: "NVIDIA X1")
    return SimpleNamespace(cuda=cuda)


def test_the_machine_line_names_the_gpu_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(True))
    assert bench.machine().endswith("; GPU: NVIDIA X1")
    monkeypatch.setitem(sys.modules, "torch", _torch(False))
    assert "GPU" not in bench.machine()


def test_record_appends_date_machine_command_and_body(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(True))
    monkeypatch.setattr(sys, "argv", ["mgserve", "bench", "spec", "--device", "cuda"])
    out = tmp_path / "B.md"
    bench.record("a title", "| a | table |", out)
    text = out.read_text()
    assert "## a title" in text and "; GPU: NVIDIA X1" in text
    assert "- command: `mgserve bench spec --device cuda`" in text
    assert text.endswith("| a | table |\n")
