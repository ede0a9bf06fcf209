"""The counters of the last-CTA kernels (cuda/tickets.py), handed out on the CPU: a run per
weight, kept while it is big enough, a new one when it is not, None when the buffer is spent."""

from __future__ import annotations

import threading

import torch

from mgserve.cuda.tickets import Tickets


def test_runs_per_weight() -> None:
    t = Tickets(torch.device("cpu"), size=100)
    base = t.buf.data_ptr()
    assert t.at(key=7, n=10) == base  # first run
    assert t.at(key=9, n=1) == base + 4 * 10  # the next weight's starts after it
    assert t.at(key=7, n=4) == base  # smaller: the same run
    assert t.at(key=7, n=30) == base + 4 * 11  # bigger: a new run
    assert t.at(key=7, n=30) == base + 4 * 11
    assert t.at(key=5, n=60) is None  # 41 used: 60 more do not fit
    assert t.at(key=5, n=59) == base + 4 * 41
    assert t.at(key=6, n=1) is None
    assert int(t.buf.abs().sum()) == 0  # handed out as zeros, never written here


def test_runs_per_thread() -> None:
    """Another thread (the prefill lane beside the decoder) gets runs of its own."""
    t = Tickets(torch.device("cpu"), size=100)
    mine = t.at(key=7, n=10)
    theirs: list[int | None] = []
    th = threading.Thread(target=lambda: theirs.append(t.at(key=7, n=10)))
    th.start()
    th.join()
    assert mine == t.buf.data_ptr() and theirs == [t.buf.data_ptr() + 40]
    assert t.at(key=7, n=10) == mine
