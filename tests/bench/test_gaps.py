"""``bench model --gaps`` (bench/model/gaps.py): the GPU's idle gaps in a trace, each put down to
the Python frame that launched the operation ending it and to a host wait overlapping it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mgserve.bench.model.gaps import gaps_table, summarize


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _gap_rows(lines: list[str]) -> list[str]:
    """The gaps table's rows (the operations table follows it)."""
    end = next((i for i, x in enumerate(lines) if x.startswith("GPU operations of")), len(lines))
    return [x for x in lines[:end] if x.startswith("| `")]


def _op_rows(lines: list[str]) -> list[str]:
    start = next(i for i, x in enumerate(lines) if x.startswith("GPU operations of"))
    return [x for x in lines[start:] if x.startswith("| `")]


def _trace() -> list[dict[str, Any]]:
    """Three kernels: the second queued by moe_prefill after a stream sync (a 300 us gap), the
    third by a norm launched late with no wait (a 50 us gap); a 10 us gap below the threshold."""
    py = "python_function"
    return [
        _x(py, "/x/mgserve/cuda/models/hybrid.py(10): block", 0, 1000),
        _x(py, "/x/mgserve/cuda/ops/moe_prefill.py(123): moe_prefill", 50, 500),
        _x(py, "/x/mgserve/cuda/ops/norm.py(40): rms_norm", 600, 100),
        _x(py, "/usr/lib/torch/nn.py(1): helper", 610, 5),  # not ours: skipped
        _x("cuda_runtime", "cudaLaunchKernel", 60, 5, correlation=1),
        _x("kernel", "router", 70, 100, tid=7, correlation=1),
        _x("cuda_runtime", "cudaStreamSynchronize", 100, 350),
        _x("cuda_runtime", "cudaLaunchKernel", 460, 5, correlation=2),
        _x("kernel", "experts", 470, 150, tid=7, correlation=2),
        _x("cuda_runtime", "cuLaunchKernelEx", 612, 5, correlation=3),
        _x("kernel", "norm", 670, 20, tid=7, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 680, 5, correlation=4),
        _x("gpu_memcpy", "Memcpy DtoH", 700, 10, tid=8, correlation=4),
    ]


def test_gaps_are_summed_by_the_launching_frame_and_the_host_wait() -> None:
    lines = summarize(_trace(), "a step", 2.0)
    assert lines[0].startswith("GPU idle gaps of a step (>= 20 us): 0.35 ms in 2 gaps of 0.64 ms")
    rows = _gap_rows(lines)
    assert rows == [
        "| `cuda/ops/moe_prefill.py: moe_prefill; cudaStreamSynchronize` | 1 | 0.300 |",
        "| `cuda/ops/norm.py: rms_norm` | 1 | 0.050 |",
    ]


def test_no_gpu_operations_say_so() -> None:
    trace = [e for e in _trace() if e["cat"] not in ("kernel", "gpu_memcpy")]
    assert summarize(trace, "a step", 1.0) == [
        "GPU idle gaps of a step: no GPU operations in the trace"
    ]


def test_gaps_table_runs_the_work_under_the_profiler() -> None:
    ran: list[int] = []
    lines = gaps_table(lambda: None, lambda: ran.append(1), "nothing on a GPU")
    assert ran == [1] and lines == [
        "GPU idle gaps of nothing on a GPU: no GPU operations in the trace"
    ]


def test_a_copy_queued_from_pinned_memory_is_no_host_wait() -> None:
    """``cudaMemcpyAsync`` returns at once for pinned memory (the step inputs' ``to_device``):
    a gap it overlaps is the launching frame's alone; from pageable memory the call waits."""
    py = "python_function"

    def trace(source: str) -> list[dict[str, Any]]:
        return [
            _x(py, "mgserve/cuda/runner.py(226): _prefill", 0, 1000),
            _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
            _x("kernel", "embed", 20, 30, tid=7, correlation=1),
            _x("cuda_runtime", "cudaMemcpyAsync", 60, 40, correlation=2),  # in the 50-150 gap
            _x("gpu_memcpy", f"Memcpy HtoD ({source} -> Device)", 150, 5, tid=7, correlation=2),
        ]

    rows = [r for r in _gap_rows(summarize(trace("Pinned"), "a step", 1.0))]
    assert rows == ["| `cuda/runner.py: _prefill` | 1 | 0.100 |"]
    rows = [r for r in _gap_rows(summarize(trace("Pageable"), "a step", 1.0))]
    assert rows == ["| `cuda/runner.py: _prefill; cudaMemcpyAsync` | 1 | 0.100 |"]


def test_frames_of_a_real_profiler_trace_are_found(tmp_path: Any) -> None:
    """The Python frames as torch.profiler writes them (``mgserve/...py(line): func``, the
    thread's system id as tid, microsecond floats), with a launch and a kernel put inside one."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from mgserve.bench.model import gaps

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        gaps._short("x.py(1): f")
    p.export_chrome_trace(str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    (frame,) = [e for e in events if e.get("cat") == "python_function" and "_short" in e["name"]]
    assert frame["name"].startswith("mgserve/bench/model/gaps.py(")
    at, tid = frame["ts"] + frame["dur"] / 2, frame["tid"]
    events += [
        _x("kernel", "a", at - 100, 10, tid=7, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", at, 0, tid=tid, correlation=2),
        _x("kernel", "b", at + 50, 10, tid=7, correlation=2),
    ]
    rows = _gap_rows(summarize(events, "a call", 1.0))
    assert rows == ["| `bench/model/gaps.py: _short` | 1 | 0.140 |"]


def test_gaps_by_op_family_ranges() -> None:
    """With labels, the innermost range of those names around a launch is the cause; launches
    outside every range say so; Python frames are not used."""
    trace = [e for e in _trace() if e["cat"] != "python_function"] + [
        _x("user_annotation", "moe.prefill", 40, 520),
        _x("user_annotation", "linear.matmul", 455, 20),  # nested in moe.prefill: innermost
        _x("user_annotation", "norm.rms", 600, 5),  # ends before the launch at 612
        _x("cuda_runtime", "cudaLaunchKernel", 458, 1, correlation=5),  # in linear.matmul
        _x(
            "kernel",
            "void at::native::vectorized_elementwise_kernel<4>",
            480,
            5,
            tid=7,
            correlation=5,
        ),  # runs beside "experts": no gap changes  # fmt: skip
    ]
    lines = summarize(trace, "a step", 2.0, {"moe.prefill", "linear.matmul", "norm.rms"})
    assert lines[0].endswith("profiled with op-family ranges)")
    rows = _gap_rows(lines)
    assert rows == [
        "| `linear.matmul; cudaStreamSynchronize` | 1 | 0.300 |",
        "| `(outside the op families)` | 1 | 0.050 |",
    ]
    assert _op_rows(lines) == [  # by operations: what each family launched, torch's own among them
        "| `linear.matmul` | 2 | 1 | 0.155 |",
        "| `(outside the op families)` | 2 | 0 | 0.030 |",
        "| `moe.prefill` | 1 | 0 | 0.100 |",
    ]


def test_annotated_ranges_every_family_method_and_restores_them(tmp_path: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mgserve.bench.model.gaps import annotated
    from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    ops = torch_backend()
    cpu = torch.device("cpu")
    model = load_device_model(GGUFFile(_export("qwen3", tmp_path)), ops, cpu, 1, 64)
    runner = DeviceRunner(model, cpu, graphs=False)
    work = SeqWork(slot=0, request_id="r", tokens=(5, 6, 7), start=0, sample=True,
                   sampling=SamplingParams(temperature=0.0), new_sequence=True)  # fmt: skip
    labels: set[str] = set()
    matmul = type(ops.linear).matmul
    with annotated(ops, labels), profile(activities=[ProfilerActivity.CPU]) as p:
        assert ops.linear.matmul is not matmul  # the instance's wrapper
        runner.run(ScheduledBatch(1, (work,)))
    names = {e.name for e in p.events()}
    assert {"linear.matmul", "attention.prefill", "norm.rms"} <= labels
    assert {"linear.matmul", "norm.rms"} <= names & labels  # the ranges ran
    assert "dense" not in {label.split(".")[0] for label in labels}
    assert "matmul" not in vars(ops.linear)  # restored: the class's method again
    none: set[str] = set()
    with annotated(None, none):  # no backend (--gaps-by frame): nothing wrapped
        pass
    assert not none


def test_long_gaps_are_broken_down_by_the_host_calls_running_through_them() -> None:
    """A 3 ms gap: 2 ms in numpy's take inside step_extra, 0.6 ms in step_extra itself, 0.4 ms
    in the runner's own code; calls on another thread and before the gap do not count."""
    py = "python_function"
    trace = [
        _x(py, "/x/mgserve/cuda/runner.py(217): _prefill", 0, 5000),
        _x(py, "/x/mgserve/cuda/models/qwen4exp.py(92): step_extra", 1200, 2600),
        _x(py, "<built-in method take of numpy object at 0x7f00>", 1500, 2000),
        _x(py, "/x/mgserve/cuda/ops/norm.py(40): rms_norm", 200, 100),  # before the gap
        _x(py, "/x/mgserve/cuda/ops/norm.py(40): rms_norm", 1500, 2000, tid=2),  # other thread
        _x("cuda_runtime", "cudaLaunchKernel", 100, 5, correlation=1),
        _x("kernel", "a", 110, 890, tid=7, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 3950, 5, correlation=2),
        _x("kernel", "b", 4000, 10, tid=7, correlation=2),
    ]
    lines = summarize(trace, "a step", 5.0)
    start = lines.index("| innermost call | ms |")
    rows = [x for x in lines[start + 2 :] if x.startswith("| `")][:3]
    assert rows == [
        "| `<built-in method take of numpy` | 2.000 |",
        "| `cuda/models/qwen4exp.py: step_extra` | 0.600 |",
        "| `cuda/runner.py: _prefill` | 0.400 |",
    ]


def test_ranges_give_no_host_call_table() -> None:
    """By op family the work ran without Python calls traced: no breakdown of the long gaps."""
    trace = [
        _x("user_annotation", "linear.matmul", 0, 5000),
        _x("cuda_runtime", "cudaLaunchKernel", 100, 5, correlation=1),
        _x("kernel", "a", 110, 890, tid=7, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 3950, 5, correlation=2),
        _x("kernel", "b", 4000, 10, tid=7, correlation=2),
    ]
    lines = summarize(trace, "a step", 5.0, {"linear.matmul"})
    assert lines[0].startswith("GPU idle gaps of a step (>= 20 us): 3.00 ms in 1 gaps")
    assert not any("Host calls" in x for x in lines)


def test_op_rows_give_rates_and_floors_from_the_costs() -> None:
    """With costs, each family method's row has GB/s (bytes / its operations' GPU time),
    TFLOP/s and the floor: bytes at the copy rate or flops at the peak, the larger; rows without
    costs are blank. linear.matmul: 2 operations in 155 us; moe.prefill: 1 in 100 us."""
    from mgserve.bench.model.costs import Cost
    from mgserve.bench.model.figures import Rates

    trace = [e for e in _trace() if e["cat"] != "python_function"] + [
        _x("user_annotation", "moe.prefill", 40, 520),
        _x("user_annotation", "linear.matmul", 455, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 458, 1, correlation=5),
        _x("kernel", "gemm", 480, 5, tid=7, correlation=5),
    ]
    labels = {"moe.prefill", "linear.matmul", "norm.rms"}
    costs = {
        "linear.matmul": Cost(3.1e8, 7.75e10),  # 2000 GB/s, 500 TFLOP/s; 0.100 ms at the copy
        "moe.prefill": Cost(1e6, 4.945e10),  # 10 GB/s, 494.5 TFLOP/s; 0.050 ms at the peak
        "norm.rms": Cost(1e3, 0.0),  # launched nothing: no row
    }
    lines = summarize(trace, "a step", 2.0, labels, costs, Rates(3100.0, 989.0))
    assert (
        "(bytes and flops at least per call: costs.py; floor ms: bytes at the copy rate 3100 "
        "GB/s (read+write) or flops at 989 TFLOP/s (nominal, datasheet dense f16), the larger)"
    ) in lines
    assert "| launched from | operations | of them torch's kernels | GPU ms | GB/s | TFLOP/s | " \
        "floor ms |" in lines  # fmt: skip
    assert _op_rows(lines) == [
        "| `linear.matmul` | 2 | 0 | 0.155 | 2000 | 500.0 | 0.100 |",
        "| `(outside the op families)` | 2 | 0 | 0.030 | | | |",
        "| `moe.prefill` | 1 | 0 | 0.100 | 10 | 494.5 | 0.050 |",
    ]
    no_rates = _op_rows(summarize(trace, "a step", 2.0, labels, costs))
    assert no_rates[0] == "| `linear.matmul` | 2 | 0 | 0.155 | 2000 | 500.0 | |"
    assert _op_rows(summarize(trace, "a step", 2.0, labels))[0] == (
        "| `linear.matmul` | 2 | 0 | 0.155 |"  # no costs: the table as before
    )


def test_a_long_gap_full_of_calls_keeps_its_enclosing_frames() -> None:
    """A 100 ms gap holding 30,000 short calls inside ``gather_rows`` inside ``_prefill``: every
    call is seen (none put down to "(no Python call)"), the enclosing frames included."""
    py = "python_function"
    trace = [
        _x(py, "/x/mgserve/cuda/runner.py(217): _prefill", 0, 200_000),
        _x(py, "/x/mgserve/core/reference/ple.py(104): gather_rows", 1000, 100_000),
        *(
            _x(py, "/g/gguf/quants.py(313): dequantize_blocks", 1000 + 3 * i, 3)
            for i in range(30_000)
        ),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("kernel", "a", 20, 980, tid=7, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 100_990, 5, correlation=2),
        _x("kernel", "b", 101_000, 10, tid=7, correlation=2),
    ]
    lines = summarize(trace, "a step", 101.0)
    start = lines.index("| innermost call | ms |") + 2
    end = lines.index("", start)  # the host table ends where the operations table's gap starts
    rows = {x.split("`")[1]: float(x.rsplit("|", 2)[1]) for x in lines[start:end]}
    assert "(no Python call)" not in rows
    assert rows["/g/gguf/quants.py(313): dequantize_blocks"] == 90.0
    assert rows["core/reference/ple.py: gather_rows"] == 10.0
