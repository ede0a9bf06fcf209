"""Where the processes of a layer pipeline across hosts meet: ``--dist-world-size``,
``--dist-rank``, ``--dist-init`` and ``--dist-backend``, or the variables torchrun sets (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``); a flag wins over a variable.

A world of one process (the default) is no pipeline: ``rendezvous`` returns None and nothing
here runs. Otherwise ``join`` starts ``torch.distributed``: the default process group (NCCL on
GPUs, gloo on the CPU) carries the stages' hand-offs and the logits (``DistTransport``), and a
gloo group of its own, the control channel, carries rank 0's steps to the others (lockstep.py).
The control group waits as long as a server may stay idle (``IDLE``): its followers block on it
between requests; a rank that dies closes its connections, so the others' wait ends in an error
rather than at the timeout.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, NamedTuple

from mgserve import env
from mgserve.config import Settings

log = logging.getLogger(__name__)

IDLE = datetime.timedelta(days=3650)  # how long a follower waits for rank 0's next step


class Rendezvous(NamedTuple):
    rank: int  # 0 serves HTTP and schedules; rank r runs stage r
    world_size: int  # processes, one stage each
    init_method: str  # torch.distributed's URL: tcp://HOST:PORT, file://PATH or env://
    backend: str  # auto | gloo | nccl (auto: by the device, ``join``)


def rendezvous(settings: Settings) -> Rendezvous | None:
    """The pipeline this process belongs to, from the settings and torchrun's variables; None
    for one process. ValueError when a world of several lacks a rank or a meeting place."""
    tr = env.torchrun()
    world = settings.dist_world_size or _int(tr, "WORLD_SIZE", 1)
    if world <= 1:
        return None
    rank = settings.dist_rank if settings.dist_rank >= 0 else _int(tr, "RANK", -1)
    if not 0 <= rank < world:
        raise ValueError(
            f"a pipeline of {world} processes needs this one's rank (0 to {world - 1}): "
            "--dist-rank or RANK"
        )
    init = settings.dist_init
    if init is None:
        if "MASTER_ADDR" not in tr or "MASTER_PORT" not in tr:
            raise ValueError(
                f"a pipeline of {world} processes needs a meeting place: --dist-init "
                "tcp://HOST:PORT (rank 0's host), or MASTER_ADDR and MASTER_PORT (torchrun)"
            )
        init = "env://"
    return Rendezvous(rank, world, init, settings.dist_backend)


def _int(tr: dict[str, str], name: str, default: int) -> int:
    if name not in tr:
        return default
    try:
        return int(tr[name])
    except ValueError:
        raise ValueError(f"{name}={tr[name]!r} is not a whole number") from None


def local_gpu(rv: Rendezvous) -> None:
    """Several ranks on one host (torchrun's LOCAL_RANK) and no GPU named: rank LOCAL_RANK
    takes that GPU, so two ranks never pick the same freest one (``machine.choose_gpu``)."""
    local = env.torchrun().get("LOCAL_RANK")
    if local is not None and not env.is_set("CUDA_VISIBLE_DEVICES"):
        env.show_only_gpu(local)
        log.info("rank %d: GPU %s of this host (LOCAL_RANK)", rv.rank, local)


def join(rv: Rendezvous, device: str) -> Any:
    """Start torch.distributed for ``rv`` on ``device`` ("cpu" or "cuda"); the control group."""
    import torch.distributed as dist

    backend = rv.backend if rv.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise ValueError("--dist-backend nccl needs GPUs (--device cuda); use gloo on the CPU")
    log.info("rank %d of %d: joining at %s (%s)", rv.rank, rv.world_size, rv.init_method, backend)
    dist.init_process_group(
        backend, init_method=rv.init_method, rank=rv.rank, world_size=rv.world_size
    )
    return dist.new_group(backend="gloo", timeout=IDLE)


def agree(control: Any, settings: Settings, g: Any, state_bytes: int) -> int:
    """Every rank serves the same model with the same slots and split: ValueError on all ranks if
    not. The largest of the ranks' ``state_bytes`` (a slot's recurrent state in a rank's stage):
    the unit of rank 0's host-RAM budget for checkpoints, which every rank keeps of its part."""
    import torch.distributed as dist

    mine = (g.architecture, g.path.name, settings.parallel, settings.ctx_size,
            settings.cache_type_k, settings.cache_type_v, settings.batch_size,
            settings.pipeline_micro_batches, settings.tensor_split)  # fmt: skip
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, int(state_bytes)), group=control)
    if any(x[0] != every[0][0] for x in every):
        raise ValueError(
            "the pipeline's processes differ in (architecture, model file, --parallel, "
            "--ctx-size, cache types, --batch-size, --pipeline-micro-batches, --tensor-split): "
            f"{[x[0] for x in every]}"
        )
    return max(x[1] for x in every)
