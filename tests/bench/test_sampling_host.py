"""``mgserve bench sampling-host``: a decode step's sampling inputs packed on the host, timed on the
CPU as served and with the staging views made at every fill, side by side."""

from __future__ import annotations

import argparse

import pytest

from mgserve.bench import sampling_host
from tests.bench.cli_args import bench_args


def _args(**kw: object) -> argparse.Namespace:
    return bench_args(sampling_host, **{"repeat": 3, **kw})


def test_times_both_ways_for_each_session_count(capsys) -> None:
    assert sampling_host.run(_args(sessions="1,3")) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 4  # each printed as measured, then the table
    for line in rows:
        kept, fresh, ratio = line.strip("| ").split(" | ")[1:]
        assert float(kept) > 0 and float(fresh) > 0
        assert ratio.endswith("x") and float(ratio[:-1]) > 0


def test_refuses_a_bad_session_count() -> None:
    with pytest.raises(ValueError, match="--sessions '0': positive counts"):
        sampling_host.run(_args(sessions="0"))
