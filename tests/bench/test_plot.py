"""``mgserve bench plot``: the depth sweep of ``bench model --json`` files drawn as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mgserve.bench.plot import series
from mgserve.cli import main


def _rows(tps0: float) -> list[dict]:
    rows = [
        {
            "workload": "w",
            "tokens_per_s": tps0 - d / 1e4,
            "kind": "decode",
            "sessions": 1,
            "depth": d,
        }
        for d in (131072, 0, 32768)
    ]
    rows += [
        {
            "workload": "w",
            "tokens_per_s": 5 * tps0,
            "kind": "decode",
            "sessions": 5,
            "depth": 32768,
        },
        {"workload": "w", "tokens_per_s": 4000.0, "kind": "prefill", "sessions": 1, "depth": 0},
        {"workload": "w", "tokens_per_s": 900.0, "kind": "prompt", "sessions": 5, "tokens": 131072},
    ]
    return rows


def test_series_group_by_kind_and_sessions_sorted_by_depth() -> None:
    s = series(_rows(100.0))
    assert list(s) == [("decode", 1), ("decode", 5), ("prefill", 1)]  # prompt rows have no depth
    assert [d for d, _ in s[("decode", 1)]] == [0, 32768, 131072]
    assert s[("decode", 5)] == [(32768, 500.0)]


def test_plot_writes_a_png_of_several_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = []
    for name, tps in (("before", 100.0), ("after", 120.0)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"gpu": "G", "model": "M", "rows": _rows(tps)}))
        files.append(str(f))
    out = tmp_path / "depth.png"
    assert main(["bench", "plot", *files, "--labels", "before,after", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_refuses_a_file_that_is_not_a_bench_result(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit, match="not a `bench model --json` file"):
        main(["bench", "plot", str(f), "--out", str(tmp_path / "o.png")])
    f.write_text(json.dumps({"rows": [{"workload": "w", "tokens_per_s": 1.0, "kind": "prompt"}]}))
    with pytest.raises(SystemExit, match="no decode or prefill rows"):
        main(["bench", "plot", str(f), "--out", str(tmp_path / "o.png")])


def test_plot_of_decode_rows_alone_has_one_panel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode-only sweep (``--prefill ""``) draws the decode panel alone, no empty one."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    f = tmp_path / "sweep.json"
    rows = [r for r in _rows(100.0) if r["kind"] == "decode"]
    f.write_text(json.dumps({"gpu": "G", "model": "M", "rows": rows}))
    panels: list[int] = []
    real = plt.Figure.savefig

    def spy(fig: plt.Figure, *a: object, **k: object) -> None:
        panels.append(len(fig.axes))
        real(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    assert main(["bench", "plot", str(f), "--out", str(tmp_path / "d.png")]) == 0
    assert panels == [1]
