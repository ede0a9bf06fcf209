"""Defaults from what the process may use (issue 15): CPU threads from the affinity mask and the
cgroup quota, the GPU with the most free memory when several are visible and none is named."""

from __future__ import annotations

import os

import pytest

from mgserve import env, machine


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000", None),
        ("200000 100000", 2.0),
        ("150000 100000", 1.5),
        ("", None),
        ("garbage", None),
        ("-1 100000", None),
        (None, None),
    ],  # fmt: skip
)
def test_cgroup_v2_cpu_max_is_read_as_cpus(text: str | None, cpus: float | None) -> None:
    assert machine.quota_cpus(text) == cpus


@pytest.mark.parametrize(
    ("affinity", "quota", "threads"),
    [(64, None, 64), (64, 2.0, 2), (64, 1.5, 1), (64, 0.5, 1), (4, 16.0, 4), (0, None, 1)],
)
def test_threads_are_the_affinity_lowered_to_the_quota(
    affinity: int, quota: float | None, threads: int
) -> None:
    assert machine.cpu_limit(affinity, quota) == threads


def test_available_cpus_never_exceeds_the_affinity_mask() -> None:
    n = machine.available_cpus()
    assert 1 <= n <= len(os.sched_getaffinity(0))


def test_the_default_thread_count_follows_the_cgroup_quota(tmp_path, monkeypatch) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")  # docker --cpus 1
    monkeypatch.setattr(machine, "CGROUP_V2_CPU_MAX", cpu_max)
    assert machine.available_cpus() == 1
    import torch

    from mgserve.core.models import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_gpu_with_most_free_memory_is_picked_the_first_of_equals() -> None:
    assert machine.pick_gpu([("GPU-a", 10), ("GPU-b", 30), ("GPU-c", 20)]) == "GPU-b"
    assert machine.pick_gpu([("GPU-a", 30), ("GPU-b", 30)]) == "GPU-a"
    assert machine.pick_gpu([("GPU-a", 5)]) == "GPU-a"
    assert machine.pick_gpu([]) is None


def test_choose_gpu_narrows_cuda_to_the_freest_only_when_none_is_named(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(machine, "_gpus_free", lambda: [("GPU-a", 1 << 30), ("GPU-b", 9 << 30)])
    assert machine.choose_gpu() == "GPU-b"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    # named by the user (even as ""): left alone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert machine.choose_gpu() is None and env.get("CUDA_VISIBLE_DEVICES") == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(machine, "_gpus_free", lambda: [("GPU-a", 1 << 30)])  # one GPU
    assert machine.choose_gpu() is None and not env.is_set("CUDA_VISIBLE_DEVICES")


def test_gpu_free_reads_nvidia_smi_by_index_or_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The free memory of the GPUs a pipeline's ranks will see (pipeline/launch.py), named by
    index or UUID as CUDA_VISIBLE_DEVICES names them; None where nvidia-smi says nothing."""
    import subprocess
    import types

    out = "0, GPU-a, 100\n1, GPU-b, 200\nbad line\n"
    monkeypatch.setattr(machine.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(stdout=out))  # fmt: skip
    assert machine.gpu_free(["GPU-b", "0", "7"]) == [200 << 20, 100 << 20, None]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert machine.gpu_ids() == ["GPU-a", "GPU-b"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    assert machine.gpu_ids() == ["3", "1"]

    def missing(*a: object, **k: object) -> None:
        raise subprocess.SubprocessError("no nvidia-smi")

    monkeypatch.setattr(machine.subprocess, "run", missing)
    assert machine.gpu_free(["0"]) == [None]
