"""``mgserve bench ple-host``: the PLE host work of a decode step timed on the CPU; its rows
decoded by the project's numpy code are checked bitwise against gguf's before timing."""

from __future__ import annotations

import argparse

import pytest

from mgserve.bench import ple_host
from tests.bench.cli_args import bench_args


def _args(**kw: object) -> argparse.Namespace:
    return bench_args(ple_host, **{"repeat": 3, **kw})


@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0"])
def test_times_each_piece_for_each_session_count(qtype: str, capsys) -> None:
    assert ple_host.run(_args(type=qtype, sessions="1,3")) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 4  # each printed as measured, then the table
    for line in rows:
        cells = [float(c) for c in line.strip("| ").split(" | ")[1:]]
        assert len(cells) == 5 and all(c > 0 for c in cells)
    assert f"a {qtype} table" in out


def test_refuses_a_type_it_cannot_decode() -> None:
    with pytest.raises(ValueError, match="--type Q4_K: one of Q8_0"):
        ple_host.run(_args(type="Q4_K"))
