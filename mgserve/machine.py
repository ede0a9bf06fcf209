"""What this process may use, for the defaults that depend on it: the CPU cores it can run on
(affinity mask and cgroup CPU quota, not the machine's core count) and, among several visible GPUs,
the one with the most free memory.

The readers are thin; the decisions are pure functions of what they read, so they are tested on
any machine.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from mgserve import env

log = logging.getLogger(__name__)

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def quota_cpus(cpu_max: str | None) -> float | None:
    """CPUs a cgroup v2 ``cpu.max`` text (``"200000 100000"``: 2 CPUs; ``"max 100000"``: no
    limit) allows, or None when it sets no limit or cannot be read."""
    if not cpu_max:
        return None
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_limit(affinity: int, quota: float | None) -> int:
    """Threads worth running: the cores the process may run on, lowered to its CPU quota (whole
    CPUs, rounded down: 1.5 CPUs of quota run one thread at full speed), at least 1."""
    n = max(1, affinity)
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return n


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def available_cpus() -> int:
    """The CPU threads this process can use: its affinity mask (``taskset``, ``docker
    --cpuset-cpus``) and its cgroup quota (``docker --cpus``, Kubernetes limits), v2 or v1."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        affinity = os.cpu_count() or 1
    quota = quota_cpus(_read(CGROUP_V2_CPU_MAX))
    if quota is None:
        q, p = _read(CGROUP_V1_QUOTA), _read(CGROUP_V1_PERIOD)
        quota = quota_cpus(f"{q} {p}") if q and p and q != "-1" else None
    return cpu_limit(affinity, quota)


def pick_gpu(free: Sequence[tuple[str, int]]) -> str | None:
    """The id of the GPU with the most free bytes among (id, free bytes) pairs, the first of
    equals; None when there are none."""
    if not free:
        return None
    return max(enumerate(free), key=lambda e: (e[1][1], -e[0]))[1][0]


def _nvidia_smi() -> list[tuple[str, str, int]]:
    """(index, UUID, free bytes) per GPU as ``nvidia-smi`` reports them (NVML: no CUDA context
    made); empty when it is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            gpus.append((parts[0], parts[1], int(parts[2]) << 20))
    return gpus


def _gpus_free() -> list[tuple[str, int]]:
    """(UUID, free bytes) per GPU (``_nvidia_smi``)."""
    return [(uuid, free) for _, uuid, free in _nvidia_smi()]


def gpu_free(ids: Sequence[str]) -> list[int | None]:
    """Free bytes of each GPU of ``ids`` (``CUDA_VISIBLE_DEVICES`` values: UUIDs or indices) as
    ``nvidia-smi`` reports them, without a CUDA context; None where it does not say."""
    free: dict[str, int] = {}
    for index, uuid, n in _nvidia_smi():
        free[index] = free[uuid] = n
    return [free.get(i) for i in ids]


def gpu_ids() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` values: that variable's entries
    where it is set (CUDA's order), else every GPU ``nvidia-smi`` lists, by UUID, in its (PCI)
    order, which ``--device-list`` ordinals then name."""
    if env.is_set("CUDA_VISIBLE_DEVICES"):
        return [x.strip() for x in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if x.strip()]
    return [uuid for uuid, _ in _gpus_free()]


def choose_gpu() -> str | None:
    """When no GPU is named (``CUDA_VISIBLE_DEVICES`` unset) and several are present, make the one
    with the most free memory the only one CUDA sees, so that it is "GPU 0" for everything after;
    its UUID, or None when nothing was changed. Call it before anything starts CUDA (torch reads
    the variable once); with one GPU, or a variable set by the user, it does nothing."""
    if env.is_set("CUDA_VISIBLE_DEVICES"):
        return None
    gpus = _gpus_free()
    if len(gpus) < 2:
        return None
    best = pick_gpu(gpus)
    if best is None:
        return None
    env.show_only_gpu(best)
    free = dict(gpus)[best]
    log.info(
        "%d GPUs and none named: serving on %s, the one with the most free memory (%.1f GiB; "
        "set CUDA_VISIBLE_DEVICES to choose)",
        len(gpus),
        best,
        free / (1 << 30),
    )
    return best
