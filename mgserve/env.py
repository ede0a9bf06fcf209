"""The only place mgserve reads the process environment.

Settings come from ``MGSERVE_<NAME>`` variables named in ``mgserve/config.py``; a few non-setting
variables (the user's cache directory, ``CUDA_VISIBLE_DEVICES``, torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``) are read here too, and the
variables mgserve writes (``CUDA_VISIBLE_DEVICES``, ``machine.choose_gpu``; ``NCCL_P2P_DISABLE``
for a benchmark) are written here, so a grep finds every one; and here is the environment of
the ranks a pipeline of one host starts (``for_child``).
"""

from __future__ import annotations

import os
from pathlib import Path


def get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def is_set(name: str) -> bool:
    """Whether ``name`` is set at all (``CUDA_VISIBLE_DEVICES=""`` names no GPU: it is set)."""
    return name in os.environ


def show_only_gpu(gpu: str) -> None:
    """Make CUDA see only ``gpu`` (an index or a UUID) from its first use in this process."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu


TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def nccl_without_p2p() -> None:
    """NCCL moves this process's data through host memory, never by peer copies between GPUs
    (``NCCL_P2P_DISABLE=1``): the PCIe-without-P2P case, forced (``bench pipeline-dist``)."""
    os.environ["NCCL_P2P_DISABLE"] = "1"


def for_child(settings: dict[str, str], gpu: str | None) -> dict[str, str]:
    """The environment of a rank this process starts (pipeline/launch.py): this one's without
    ``MGSERVE_*`` and torchrun's variables, plus ``settings`` (``MGSERVE_*`` values), and
    ``CUDA_VISIBLE_DEVICES`` = ``gpu`` when given."""
    out = {
        k: v for k, v in os.environ.items() if not k.startswith("MGSERVE_") and k not in TORCHRUN
    }
    out.update(settings)
    if gpu is not None:
        out["CUDA_VISIBLE_DEVICES"] = gpu
    return out


def torchrun() -> dict[str, str]:
    """The rendezvous variables torchrun (or a user) set for this process: those of TORCHRUN that
    are set. torch.distributed's ``env://`` reads MASTER_ADDR and MASTER_PORT itself."""
    return {name: v for name in TORCHRUN if (v := get(name)) is not None}


def cache_dir(configured: str | None = None) -> Path:
    """Where mgserve keeps the assembled built-in model and compiled kernels."""
    if configured:
        return Path(configured)
    xdg = get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "mgserve"
