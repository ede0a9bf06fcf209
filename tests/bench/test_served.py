"""The served step's split by the operations that move its timeline (bench/model/served.py)."""

from __future__ import annotations

import pytest

from mgserve.bench.model.served import split_table, split_timeline
from mgserve.bench.model.trace import gpu_ops


def test_serial_operations_add_their_durations_and_gaps_are_idle() -> None:
    s = split_timeline([("a", 0, 10), ("b", 15, 20), ("a", 20, 30)])
    assert s.rows["a"].adds == 20 and s.rows["a"].count == 2 and s.rows["a"].own == 20
    assert s.rows["b"].adds == 5
    assert s.idle == 5 and s.span == 30


def test_early_launch_adds_only_past_its_predecessor() -> None:
    # b launched at 4 (programmatic dependent launch), waited for a, ended at 12: it adds 2
    s = split_timeline([("b", 4, 12), ("a", 0, 10)])
    assert s.rows["a"].adds == 10 and s.rows["b"].adds == 2
    assert s.rows["b"].own == 8 and s.idle == 0 and s.span == 12


def test_overlapped_side_chain_adds_nothing() -> None:
    s = split_timeline([("main", 0, 50), ("side", 10, 40), ("next", 50, 60)])
    assert s.rows["side"].adds == 0 and s.rows["side"].own == 30
    assert s.rows["main"].adds == 50 and s.rows["next"].adds == 10


@pytest.mark.parametrize("seed", range(5))
def test_additions_and_idle_sum_to_the_span(seed: int) -> None:
    import random

    rng = random.Random(seed)
    ops = []
    for i in range(200):
        start = rng.uniform(0, 1000)
        ops.append((f"k{i % 7}", start, start + rng.expovariate(1 / 20)))
    s = split_timeline(ops)
    total = sum(r.adds for r in s.rows.values()) + s.idle
    assert total == pytest.approx(s.span)
    assert s.span == pytest.approx(max(e for _, _, e in ops) - min(b for _, b, _ in ops))
    assert sum(r.count for r in s.rows.values()) == 200


def test_rejects_an_operation_that_ends_before_it_starts() -> None:
    with pytest.raises(ValueError, match="k: ends at 1"):
        split_timeline([("k", 5, 1)])


def test_table_is_per_step_and_folds_the_tail() -> None:
    ops = [(f"k{i}", 10.0 * i, 10.0 * i + 10) for i in range(4)]
    ops += [(f"k{i}", 100 + 10.0 * i, 100 + 10.0 * i + 10) for i in range(4)]
    lines = split_table(split_timeline(ops), "two steps", steps=2, top=2)
    assert lines[0].startswith("time each GPU operation adds to two steps, per step: 0.070 ms")
    assert "0.030 ms of it idle" in lines[0] and "4 operations (2 steps profiled)" in lines[0]
    assert lines[4] == "| `k0` | 1 | 0.010 | 14.3% | 0.010 |"
    assert lines[-1] == "| (2 others) | 2 | 0.020 | 28.6% | 0.020 |"


def test_gpu_ops_takes_kernels_copies_and_sets_only() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": 2.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 4.0, "dur": 1.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 1.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0.0},
    ]
    assert gpu_ops(events) == [("k", 1.0, 3.0), ("Memcpy HtoD", 4.0, 5.0)]
