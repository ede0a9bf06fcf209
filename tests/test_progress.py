"""Start-up progress (issue 15): the fraction only grows through its phases' bands; a terminal
gets one bar redrawn in place, a log gets a plain line every 10%."""

from __future__ import annotations

import io
import logging

from mgserve import progress


def test_tensors_fill_the_weights_band_once_each_and_kernels_the_rest() -> None:
    p = progress.Progress()
    with progress.tracking(p):
        progress.tensor_read("a", 4)
        progress.tensor_read("a", 4)  # asked again: counted once
        progress.tensor_read("b", 4)
        assert p.fraction == 0.45 and p.phase == "weights"
        progress.kernel_ready("k.cu", 2)
        assert p.fraction == 0.95 and p.phase == "kernels"
        progress.tensor_read("c", 4)  # a later weight does not move the fraction back
        assert p.fraction == 0.95
    progress.tensor_read("d", 4)  # not tracked any more
    assert p.fraction == 0.95
    p.finish()
    assert (p.fraction, p.phase) == (1.0, "ready")


def test_a_terminal_gets_one_bar_redrawn_in_place() -> None:
    out = io.StringIO()
    p = progress.Progress(out, tty=True)
    for i in range(10):
        p.item("weights", str(i), 10)
    p.finish()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended at the finish
    assert text.count("\r") == 11
    assert "loading [" in text and "100% ready" in text


def test_a_log_gets_a_line_every_tenth(caplog) -> None:
    caplog.set_level(logging.INFO, logger="mgserve.load")
    p = progress.Progress(io.StringIO(), tty=False)
    for i in range(100):
        p.item("weights", str(i), 100)
    lines = [r.getMessage() for r in caplog.records if r.name == "mgserve.load"]
    assert lines[0] == "loading: 10% (weights 12/100)"
    assert len(lines) == 9  # 10% .. 90%: the weights band ends at 0.9
