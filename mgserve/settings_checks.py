"""The checks of a ``Settings``' values (config.py declares the table, this says what is
acceptable): ranges, choices, the GPU lists (devices.py) and the pipeline's rendezvous. Each
failure is a ``ValueError`` naming the flag."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from mgserve import env
from mgserve.devices import check_devices

if TYPE_CHECKING:
    from mgserve.config import Settings

# the least value of a whole-number setting
MINIMUM = {"ctx_size": 0, "parallel": 1, "batch_size": 0, "checkpoint_every": -1,
           "ctx_checkpoints": 0, "cache_ram": 0, "prefix_copy_min": 0, "itl_target_ms": 0,
           "prefill_sessions": 0, "max_queue": 0, "reasoning_budget": -1, "threads": 0,
           "max_body_mb": 1, "virtual_stages": 1, "pipeline_micro_batches": 1, "dist_rank": -1,
           "dist_world_size": 0}  # fmt: skip
# --batch-size 0 (the default): CPU_BATCH prompt tokens a step on the CPU; on a GPU the first
# of GPU_BATCHES its memory plan holds (cuda/plan_fit.gpu_batch). On an H100 a 16384-token
# qwen4exp prompt ran at 2,555 tokens/s in chunks of 512, 8,596 of 2048, 10,311 of 4096 and
# 11,095 of 8192 (BENCHMARKS.md 2026-12-07 23:10); 4096 is what the benches and the mixed-load
# figures use.
CPU_BATCH, GPU_BATCHES = 512, (4096, 2048, 1024, 512)
INIT_SCHEMES = ("tcp://", "file://", "env://")  # torch.distributed's init_method URLs


def check_settings(s: Settings) -> None:
    if not (0 < s.port < 65536):
        raise ValueError(f"port must be in 1..65535, got {s.port}")
    for name, low in MINIMUM.items():
        if getattr(s, name) < low:
            flag = name.replace("_", "-")
            raise ValueError(f"{flag} must be >= {low}, got {getattr(s, name)}")
    check_devices(s.device_list, s.tensor_split, s.gpu_memory, _processes(s))
    if s.slot_save_path is not None and not os.path.isdir(s.slot_save_path):
        raise ValueError(f"slot-save-path is not a directory: {s.slot_save_path!r}")
    if min(s.spec_max_users, s.spec_k) < 0:
        raise ValueError(
            f"spec-max-users and spec-k must be >= 0, got {s.spec_max_users}, {s.spec_k}"
        )
    if not 1 <= s.spec_ngram_min <= s.spec_ngram_max:
        raise ValueError("spec-ngram-min and spec-ngram-max need 1 <= min <= max")
    if not 0.0 <= s.spec_min_acceptance <= 1.0:
        raise ValueError(f"spec-min-acceptance must be in [0, 1], got {s.spec_min_acceptance}")
    if s.dist_init is not None and not s.dist_init.startswith(INIT_SCHEMES):
        raise ValueError(
            f"dist-init must be a URL such as tcp://HOST:PORT or file:///path, got {s.dist_init!r}"
        )
    if s.dist_world_size and s.dist_rank >= s.dist_world_size:
        raise ValueError(
            f"dist-rank {s.dist_rank} is not below dist-world-size {s.dist_world_size}"
        )
    for f in dataclasses.fields(s):
        choices = f.metadata.get("choices")
        if choices and getattr(s, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {choices}, got {getattr(s, f.name)!r}")


def _processes(s: Settings) -> int:
    """The processes of the pipeline these settings join: --dist-world-size, else torchrun's
    WORLD_SIZE (rendezvous.py says what a bad one is), else 1."""
    if s.dist_world_size:
        return s.dist_world_size
    world = env.torchrun().get("WORLD_SIZE", "1")
    return int(world) if world.isdigit() else 1


def with_batch(s: Settings, gpu: bool) -> Settings:
    """``s`` with a ``batch_size`` of 0 made CPU_BATCH, or on a GPU GPU_BATCHES[0] (unfitted:
    the single-GPU server fits it to the memory plan, ``cuda.plan_fit.gpu_batch``)."""
    return dataclasses.replace(s, batch_size=s.batch_size or (GPU_BATCHES[0] if gpu else CPU_BATCH))
