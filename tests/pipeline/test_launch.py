"""A pipeline of this host's processes started by ``serve`` itself (pipeline/launch.py): which
settings start one, what each rank is given (its GPU, its settings as ``MGSERVE_*`` variables, a
share of ``--gpu-memory``), and what is refused. The processes themselves: test_serve_dist.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from mgserve.config import Settings, settings_from
from mgserve.pipeline import launch
from tests.cuda.test_plan import _file


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mgserve.machine.gpu_ids", lambda: ["GPU-a", "GPU-b", "GPU-c"])
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_which_settings_start_the_ranks_here(
    two_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert launch.local_ranks(Settings()) is None
    assert launch.local_ranks(Settings(device_list="2,0")) == ["GPU-c", "GPU-a"]
    assert launch.local_ranks(Settings(device_list="all")) == ["GPU-a", "GPU-b", "GPU-c"]
    assert launch.local_ranks(Settings(device_list="1")) is None  # one GPU: no pipeline
    assert launch.local_ranks(Settings(dist_world_size=3, device="cpu")) == [None] * 3
    # on GPUs, the first N: NCCL takes a GPU per rank
    assert launch.local_ranks(Settings(dist_world_size=2)) == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError, match="takes a GPU per process and 3 are here"):
        launch.local_ranks(Settings(dist_world_size=4, device="cuda"))
    with pytest.raises(ValueError, match="--device cpu runs on none"):
        launch.local_ranks(Settings(device_list="0,1", device="cpu"))
    # ranks started elsewhere: torchrun's variables, or a rank or a meeting place named
    assert launch.local_ranks(Settings(dist_world_size=2, dist_rank=0)) is None
    assert launch.local_ranks(Settings(dist_world_size=2, dist_init="tcp://h:1")) is None
    monkeypatch.setenv("RANK", "0")
    assert launch.local_ranks(Settings(device_list="0,1")) is None
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match="names 2 GPUs and --dist-world-size is 3"):
        launch.local_ranks(Settings(device_list="0,1", dist_world_size=3))
    with pytest.raises(ValueError, match="GPU 5 is not among the 3 this process sees"):
        launch.local_ranks(Settings(device_list="0,5"))


def test_each_rank_gets_its_gpu_its_settings_and_its_memory(
    two_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[dict[str, str]] = []

    class Popen:
        pid = 4242

        def __init__(self, cmd: list[str], env: dict[str, str], preexec_fn: Any) -> None:
            assert cmd[-3:] == ["-m", "mgserve", "serve"]
            assert preexec_fn is launch._die_with_parent
            started.append(env)

        def poll(self) -> Any:
            return None

    monkeypatch.setattr(launch.subprocess, "Popen", Popen)

    class Thread:  # no watcher: the children here are not processes
        def __init__(self, **kw: Any) -> None:
            pass

        def start(self) -> None:
            pass

    monkeypatch.setattr(launch.threading, "Thread", Thread)
    monkeypatch.setattr(launch.atexit, "register", lambda *a: None)
    monkeypatch.setattr(launch.env, "show_only_gpu", lambda gpu: started.append({"rank0": gpu}))
    monkeypatch.setenv("MGSERVE_PORT", "9999")  # a variable of rank 0's: resolved, not copied
    s = Settings(device_list="0,2,1", ctx_size=1234, tensor_split="1,2,1",
                 gpu_memory="24GiB,16GiB,8GiB", port=8080)  # fmt: skip
    mine = launch.launch(s, launch.local_ranks(s) or [])
    assert (mine.dist_rank, mine.dist_world_size, mine.device_list) == (0, 3, None)
    assert mine.gpu_memory == "24GiB" and mine.dist_init and mine.dist_init.startswith("tcp://")
    r1, r2, r0 = started
    assert r0 == {"rank0": "GPU-a"}
    for rank, e, gpu, mem in ((1, r1, "GPU-c", "16GiB"), (2, r2, "GPU-b", "8GiB")):
        assert e["CUDA_VISIBLE_DEVICES"] == gpu and e["MGSERVE_GPU_MEMORY"] == mem
        assert e["MGSERVE_DIST_RANK"] == str(rank) and e["MGSERVE_DIST_WORLD_SIZE"] == "3"
        assert e["MGSERVE_DIST_INIT"] == mine.dist_init
        assert (e["MGSERVE_CTX_SIZE"], e["MGSERVE_TENSOR_SPLIT"]) == ("1234", "1,2,1")
        assert e["MGSERVE_PORT"] == "8080" and "MGSERVE_DEVICE_LIST" not in e
        assert "MGSERVE_MODEL" not in e  # None: the built-in default, as on rank 0
        monkeypatch.setattr(launch.env.os, "environ", e)  # what the child reads back
        back = settings_from(None)
        want = dataclasses.replace(mine, dist_rank=rank, gpu_memory=mem)
        assert back == want


def test_the_gpus_split_the_layers_as_info_plan_does(two_gpus: None, tmp_path: Path) -> None:
    """Without ``--tensor-split`` the ranks get the stage plan's layer counts (within each GPU's
    memory), the split ``mgserve info --plan`` prints; a plan that does not fit is refused before
    any rank starts."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.pipeline.report import plan_for
    from mgserve.pipeline.stages import StagePlanError, split_shares

    path = str(_file("qwen4exp", tmp_path).path)  # 8 layers
    s = Settings(model=path, device_list="0,1", gpu_memory="1GiB,160MiB", ctx_size=32768)
    counts, batch = launch.planned_split(s, ["GPU-a", "GPU-b"])
    plan = plan_for(GGUFFile(path), s)
    want = plan.ranges
    assert split_shares(8, [float(c) for c in counts.split(",")]) == want
    assert batch == plan.settings.batch_size == 512  # automatic: the first that fits, here 512
    roomy = dataclasses.replace(s, gpu_memory="4GiB,4GiB")
    assert launch.planned_split(roomy, ["GPU-a", "GPU-b"])[1] == 4096
    assert want[0][1] - want[0][0] > want[1][1] - want[1][0]  # the smaller GPU takes fewer
    with pytest.raises(StagePlanError, match="no split of the 8 layers over 2 GPUs fits"):
        launch.planned_split(dataclasses.replace(s, gpu_memory="1GiB,120MiB"), ["GPU-a", "GPU-b"])


def test_cpu_ranks_share_the_cores(two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """N CPU processes started here take a share of the cores each (--threads 0), not all."""
    started: list[dict[str, str]] = []

    class Child:
        pid = 4242

        def __init__(self, cmd: list[str], env: dict[str, str], preexec_fn: Any) -> None:
            started.append(env)

    class Thread:
        def __init__(self, **kw: Any) -> None:
            pass

        def start(self) -> None:
            pass

    monkeypatch.setattr(launch.subprocess, "Popen", Child)
    monkeypatch.setattr(launch.threading, "Thread", Thread)
    monkeypatch.setattr(launch.atexit, "register", lambda *a: None)
    monkeypatch.setattr("mgserve.machine.available_cpus", lambda: 8)
    mine = launch.launch(Settings(device="cpu", dist_world_size=3), [None] * 3)
    assert mine.threads == 2 and [e["MGSERVE_THREADS"] for e in started] == ["2", "2"]
    mine = launch.launch(Settings(device="cpu", dist_world_size=2, threads=3), [None] * 2)
    assert mine.threads == 3  # as given


def test_an_automatic_batch_is_fitted_to_a_given_split(two_gpus: None, tmp_path: Path) -> None:
    """With ``--tensor-split`` and an automatic ``--batch-size`` the launcher keeps the split and
    fits the batch to it (what ``info --plan`` with the same flags reports); a given batch and
    split are left as they are."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.pipeline.report import plan_for

    path = str(_file("qwen4exp", tmp_path).path)
    s = Settings(model=path, device_list="0,1", gpu_memory="1GiB,160MiB", ctx_size=32768,
                 tensor_split="7,1")  # fmt: skip
    split, batch = launch.planned_split(s, ["GPU-a", "GPU-b"])
    assert split == "7,1" and batch == plan_for(GGUFFile(path), s).settings.batch_size
    assert batch in (4096, 2048, 1024, 512)
