"""The GPUs a server runs on, as users write them: ``--device-list`` (CUDA ordinals, or ``all``),
``--tensor-split`` (each GPU's share of the layers, llama.cpp's) and ``--gpu-memory`` (one size
for all, or one per GPU); parsed here so the settings table (config.py) only declares them.

The GPUs' own numbers (how many are visible, their free memory) are read by ``visible_gpus``;
CUDA_VISIBLE_DEVICES narrows what CUDA shows before any of this, as usual.
"""

from __future__ import annotations

import re

from mgserve.sizes import parse_sizes

ALL = "all"


def parse_device_list(text: str) -> tuple[int, ...] | None:
    """CUDA ordinals of ``--device-list`` (``0,1,2``), in pipeline order; None for ``all``."""
    if text.strip().lower() == ALL:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ValueError(f"device-list must be CUDA ordinals such as 0,1,2 or all, got {text!r}")
    ids = tuple(int(p) for p in parts)
    if len(set(ids)) != len(ids):
        raise ValueError(f"device-list names a GPU twice: {text!r}")
    return ids


def parse_split(text: str) -> tuple[float, ...]:
    """``--tensor-split`` shares (``3,3,2,1,2,2``), each positive."""
    try:
        shares = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"tensor-split must be numbers such as 3,3,2,1, got {text!r}") from None
    if not all(x > 0 for x in shares):
        raise ValueError(
            f"tensor-split shares must be positive (leave a GPU out with --device-list), "
            f"got {text!r}"
        )
    return shares


def check_devices(
    device_list: str | None, tensor_split: str | None, gpu_memory: str | None, processes: int = 1
) -> None:
    """ValueError for settings that cannot go together, before any GPU is looked at.
    ``processes``: a pipeline across that many processes, one stage each, whose ``tensor-split``
    gives a share per process (lockstep.py) when no GPU list is given."""
    ids = parse_device_list(device_list) if device_list is not None else None
    sizes = parse_sizes(gpu_memory, "gpu-memory") if gpu_memory is not None else None
    split = parse_split(tensor_split) if tensor_split is not None else None
    n = len(ids) if ids is not None else None
    if n is None and device_list is None and sizes is not None and len(sizes) > 1:
        n = len(sizes)  # a size per GPU names the GPUs' count (0, 1, ... by default)
    if sizes is not None and n is not None and len(sizes) not in (1, n):
        raise ValueError(f"gpu-memory gives {len(sizes)} sizes for {n} GPUs: give 1 or {n}")
    if split is not None:
        if n is None and processes > 1:
            if len(split) != processes:
                raise ValueError(f"tensor-split gives {len(split)} shares for a pipeline of "
                                 f"{processes} processes (one share per rank)")  # fmt: skip
            return
        if n is None:
            raise ValueError("tensor-split needs --device-list (or a --gpu-memory size per GPU), "
                             "or a pipeline across processes (--dist-world-size)")  # fmt: skip
        if len(split) != n:
            raise ValueError(f"tensor-split gives {len(split)} shares for {n} GPUs")


def stage_devices(
    device_list: str | None, gpu_memory: str | None, visible: int | None
) -> tuple[int, ...]:
    """The CUDA ordinals of the pipeline's stages, in order: ``--device-list``, else as many as
    ``--gpu-memory`` gives sizes (0, 1, ...), else GPU 0 alone. ``visible``: how many GPUs CUDA
    shows (None: no GPU here), for ``all`` and to refuse an ordinal it does not show."""
    ids = parse_device_list(device_list) if device_list is not None else ()
    if ids is None:
        if visible is None:
            sizes = parse_sizes(gpu_memory, "gpu-memory") if gpu_memory else [0]
            if len(sizes) < 2:
                raise ValueError("--device-list all: no GPU here; give a --gpu-memory per GPU")
            return tuple(range(len(sizes)))
        return tuple(range(visible))
    if not ids:
        n = len(parse_sizes(gpu_memory, "gpu-memory")) if gpu_memory else 1
        ids = tuple(range(n))
    if visible is not None and max(ids) >= visible:
        raise ValueError(f"--device-list {device_list}: CUDA shows {visible} GPU(s) here")
    return ids


def stage_memory(gpu_memory: str | None, devices: tuple[int, ...]) -> list[int] | None:
    """Bytes each stage's GPU may use by ``--gpu-memory`` (None: not given, ask the GPUs)."""
    if gpu_memory is None:
        return None
    sizes = parse_sizes(gpu_memory, "gpu-memory")
    return sizes * len(devices) if len(sizes) == 1 else sizes


def refuse_several(device_list: str | None, tensor_split: str | None,
                   gpu_memory: str | None) -> None:  # fmt: skip
    """ValueError for ``serve`` settings that choose GPUs of a pipeline where ``serve`` runs none
    (one process on one GPU: the freest, or the one CUDA_VISIBLE_DEVICES shows). A pipeline of
    this host's GPUs is ``--device-list`` of two or more (pipeline/launch.py)."""
    several = gpu_memory is not None and len(parse_sizes(gpu_memory, "gpu-memory")) > 1
    for flag, value in (("--device-list", device_list), ("--tensor-split", tensor_split),
                        ("--gpu-memory", gpu_memory if several else None)):  # fmt: skip
        if value is not None:
            raise ValueError(
                f"{flag} {value}: serve runs one GPU here; a layer pipeline takes --device-list "
                "with two GPUs or more (a process each), one GPU is chosen with "
                "CUDA_VISIBLE_DEVICES; `mgserve info --plan` with the same options prints the "
                "stage plan"
            )
