"""``mgserve serve --device-list 0,1,...``: the layer pipeline over several GPUs of this host, one
process per GPU, started by this one; and ``--dist-world-size N`` with neither a rank nor a
meeting place: N processes on this host (on the CPU too).

A pipeline of one host is a pipeline across processes (lockstep.py) whose ranks this process
starts itself: it becomes rank 0 (serving HTTP, on the list's first GPU) and starts ranks 1..N-1
as child processes of the same program, each seeing only its own GPU (``CUDA_VISIBLE_DEVICES``),
all meeting on a free local port. A process per GPU rather than threads of one: each GPU's host
work (the launches of a prompt chunk's kernels, the hand-offs) runs on its own core, where one
Python thread would issue every GPU's launches in turn; NCCL carries the hand-offs, by peer
copies where the GPUs reach each other and through host memory where they do not (set
``NCCL_P2P_DISABLE=1`` to force that).

The children take every setting through their ``MGSERVE_*`` variables (the resolved settings,
so flags, variables and defaults all reach them as they reached rank 0), their rank and the
meeting place. A child that exits while rank 0 runs ends rank 0 with status 1 (a pipeline
missing a stage cannot serve; a supervisor starts it again); when rank 0 stops, it tells the
children (lockstep.py) and waits for them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from mgserve import env
from mgserve.config import Settings, env_name
from mgserve.devices import parse_device_list

log = logging.getLogger(__name__)


def local_ranks(settings: Settings) -> list[str | None] | None:
    """The processes this ``serve`` starts on this host, by what each sees of the GPUs (a
    ``CUDA_VISIBLE_DEVICES`` value; None: the CPU), rank 0 first; None when it starts none:
    torchrun's variables or a ``--dist-rank`` (the ranks are started elsewhere), or neither a
    ``--device-list`` of several GPUs nor a ``--dist-world-size`` above 1."""
    tr = env.torchrun()
    if "RANK" in tr or settings.dist_rank >= 0 or settings.dist_init is not None:
        return None
    if settings.device_list is not None:
        if settings.device == "cpu":
            raise ValueError(
                f"--device-list {settings.device_list} names GPUs; --device cpu runs on none (a "
                "pipeline of CPU processes: --dist-world-size)"
            )
        gpus = _gpus(settings.device_list)
        if settings.dist_world_size not in (0, len(gpus)):
            raise ValueError(f"--device-list {settings.device_list} names {len(gpus)} GPUs and "
                             f"--dist-world-size is {settings.dist_world_size}")  # fmt: skip
        return list(gpus) if len(gpus) > 1 else None
    world = settings.dist_world_size or 1
    if world <= 1:
        return None
    if settings.device == "cpu":
        return [None] * world
    from mgserve.machine import gpu_ids

    shown = gpu_ids()  # on GPUs: the first ``world`` of them, a GPU each (NCCL needs that)
    if len(shown) >= world:
        return list(shown[:world])
    if settings.device == "cuda" or shown:
        raise ValueError(f"--dist-world-size {world}: a pipeline on GPUs takes a GPU per process "
                         f"and {len(shown)} are here (--device-list chooses them; --device cpu "
                         "runs on the CPU)")  # fmt: skip
    return [None] * world  # --device auto and no GPU: CPU processes


def _gpus(device_list: str) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each GPU of ``--device-list`` (ordinals among the
    GPUs CUDA shows this process: ``CUDA_VISIBLE_DEVICES``'s if set)."""
    from mgserve.machine import gpu_ids

    shown = gpu_ids()
    ids = parse_device_list(device_list)
    if ids is None:  # all
        ids = tuple(range(len(shown)))
        if not ids:
            raise ValueError("--device-list all: nvidia-smi shows no GPU here")
    for i in ids:
        if i >= len(shown):
            raise ValueError(f"--device-list {device_list}: GPU {i} is not among the "
                             f"{len(shown)} this process sees")  # fmt: skip
    return [shown[i] for i in ids]


def launch(settings: Settings, ranks: list[str | None]) -> Settings:
    """Start ranks 1..N-1 (``local_ranks``) as child processes; this process's settings as rank
    0, its GPU made the only one CUDA sees (call before anything starts CUDA)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = len(ranks)
    split, batch = settings.tensor_split, settings.batch_size
    if ranks[0] is not None and (split is None or not batch):  # GPUs: info --plan's split
        split, batch = planned_split(settings, [r or "" for r in ranks])  # and batch
    threads = settings.threads
    if ranks[0] is None and not threads:  # CPU ranks share this host's cores, not each take all
        from mgserve.machine import available_cpus

        threads = max(1, available_cpus() // world)
    common = dataclasses.replace(
        settings, device_list=None, dist_world_size=world, tensor_split=split, batch_size=batch,
        dist_init=f"tcp://127.0.0.1:{port}", threads=threads,
    )  # fmt: skip
    children = []
    sizes = (settings.gpu_memory or "").split(",")  # a size per GPU: each rank its own
    if len(sizes) > 1:
        if len(sizes) != world:
            raise ValueError(f"--gpu-memory {settings.gpu_memory}: {len(sizes)} sizes for "
                             f"{world} GPUs")  # fmt: skip
        common = dataclasses.replace(common, gpu_memory=sizes[0].strip())
    for rank in range(1, world):
        mine = dataclasses.replace(common, dist_rank=rank)
        if len(sizes) > 1:
            mine = dataclasses.replace(mine, gpu_memory=sizes[rank].strip())
        child_env = _env(mine, ranks[rank])
        cmd = [sys.executable, "-m", "mgserve", "serve"]
        children.append(subprocess.Popen(cmd, env=child_env, preexec_fn=_die_with_parent))
    if ranks[0] is not None:
        env.show_only_gpu(ranks[0])
    log.info("a pipeline of %d processes on this host: rank 0 here%s, ranks 1-%d started (pids %s)",
             world, f" on GPU {ranks[0]}" if ranks[0] is not None else "", world - 1,
             ", ".join(str(c.pid) for c in children))  # fmt: skip
    threading.Thread(target=_watch, args=(children,), daemon=True).start()
    atexit.register(_reap, children)
    return dataclasses.replace(common, dist_rank=0)


def planned_split(settings: Settings, gpus: list[str]) -> tuple[str, int]:
    """The layers per GPU of the stage plan (``mgserve info --plan``'s: balanced by decode weight
    bytes within each GPU's memory, ``--gpu-memory`` or what nvidia-smi says is free; or
    ``--tensor-split``'s, given as it is) as a ``--tensor-split`` of layer counts, which every
    rank splits the same way, and its ``--batch-size`` (an automatic one fitted:
    ``fitted_plan``); StagePlanError, naming what to lower, before any rank starts when the
    stages do not fit."""
    from mgserve.core.builtin_models import resolve_model
    from mgserve.core.gguf.info import model_spec
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.devices import parse_split
    from mgserve.machine import gpu_free
    from mgserve.pipeline.costs import ModelCosts
    from mgserve.pipeline.report import render
    from mgserve.pipeline.stages import StagePlanError, fitted_plan
    from mgserve.settings_checks import GPU_BATCHES
    from mgserve.sizes import parse_sizes

    g = GGUFFile(resolve_model(settings.model, settings.cache_dir))
    s = settings.for_model(model_spec(g).n_ctx_train)
    if s.gpu_memory is not None:
        sizes = parse_sizes(s.gpu_memory, "gpu-memory")
        texts = [t.strip() for t in s.gpu_memory.split(",")]
        each = [i if len(sizes) > 1 else 0 for i in range(len(gpus))]
        free = [(sizes[i], f"--gpu-memory {texts[i]}") for i in each]
    else:
        found = gpu_free(gpus)
        if any(f is None for f in found) and s.tensor_split:  # a split given: the batch unfitted
            return s.tensor_split, s.batch_size or GPU_BATCHES[0]
        if any(f is None for f in found):
            raise StagePlanError(
                f"nvidia-smi does not say the free memory of GPUs {gpus}: give --gpu-memory "
                "(one size, or one per GPU) or --tensor-split"
            )
        free = [(f or 0, "free (nvidia-smi)") for f in found]
    costs = ModelCosts.of(g, s.cache_type_k, s.cache_type_v)
    given = parse_split(s.tensor_split) if s.tensor_split else None
    plan = fitted_plan(costs, s, tuple(range(len(gpus))), free, given)
    log.info("%s", render(plan))
    split = s.tensor_split or ",".join(str(b - a) for a, b in plan.ranges)
    return split, plan.settings.batch_size


def _env(settings: Settings, gpu: str | None) -> dict[str, str]:
    """A child's environment: every setting as its ``MGSERVE_*`` variable (none for a setting
    that is None), its GPU the only one CUDA sees (``env.for_child``)."""
    values = {env_name(f.name): str(getattr(settings, f.name)) for f in dataclasses.fields(settings)
              if getattr(settings, f.name) is not None}  # fmt: skip
    return env.for_child(values, gpu)


def _die_with_parent() -> None:
    """In a child before it runs: the kernel kills it when rank 0's process ends, however it
    ends (``os._exit`` on a fatal error, SIGKILL), so no rank outlives the pipeline."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _watch(children: list[subprocess.Popen[bytes]]) -> None:
    """Rank 0 ends with status 1 when a child exits first (the module docstring); the other
    children die with it (``_die_with_parent``)."""
    while True:
        for c in children:
            code = c.poll()  # 0 only once rank 0 has told it to stop
            if code and not _stopping.is_set():
                log.critical("rank %d (pid %d) exited with %d; the pipeline cannot go on",
                             children.index(c) + 1, c.pid, code)  # fmt: skip
                logging.shutdown()
                os._exit(1)
        time.sleep(0.5)


_stopping = threading.Event()  # rank 0 is exiting: its children end too


def _reap(children: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """At rank 0's exit: wait for the children (told to stop by the Leader), kill the slow."""
    _stopping.set()
    end = time.monotonic() + timeout
    for c in children:
        try:
            c.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank pid %d did not stop; killing it", c.pid)
            c.kill()
            c.wait()
