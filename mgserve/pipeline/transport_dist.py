"""``DistTransport``: a layer pipeline's stages in several processes (other hosts), joined by
``torch.distributed`` (gloo on the CPU, NCCL on GPUs); the ``Transport`` of transport.py.

A hand-off is a point-to-point send from the rank of stage i to the rank of stage i + 1. It is
sent without waiting (``isend``): the sender goes on with its next work (the next prompt chunk,
or the next micro-batch of a decode step's sessions) while the receiver still computes the one
before, which is what lets the stages of different processes run at once. A send's tensor is
kept until the send completes, and at most ``IN_FLIGHT`` sends per link are outstanding: the
next waits for the oldest, so a fast first stage runs at most that far ahead of its receiver (a
qwen4exp hand-off of a 4096-token chunk is 168 MB). Across processes the ranks agree on a step
by running the same ``ScheduledBatch`` (lockstep.py), so they need no other message for it.

The last stage's logits are broadcast to every rank, so that every process samples the same
tokens (its runner stays in step with the others: the same sampler, seeds and states on every
rank). A step that wants no logits (a prompt chunk before the prompt's last) broadcasts nothing:
a broadcast, even of nothing, waits for every rank, and would hold the first stage until the
last has finished the chunk. Pipelined prefill is that: chunk c + 1 on stage 0 while chunk c is
on stage 1.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from mgserve.pipeline.transport import HANDOFF_DTYPE

IN_FLIGHT = 2  # outstanding sends per link (each holds its hand-off's tensor)


class DistTransport:
    """Stages in several processes (the module docstring): ``ranks[i]`` is the rank that computes
    stage i; the process group is initialized."""

    def __init__(self, ranks: Sequence[int], rank: int | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.ranks, self.n_stages = list(ranks), len(ranks)
        self.rank = dist.get_rank() if rank is None else rank
        self.local: dict[int, torch.Tensor] = {}  # hand-offs between stages of this rank
        self.pending: list[deque[tuple[Any, torch.Tensor]]] = [
            deque() for _ in range(max(0, self.n_stages - 1))
        ]  # per link: (work, tensor) of the sends not yet known to be complete
        self.link_bytes = [0] * max(0, self.n_stages - 1)  # bytes this rank sent on each link

    def runs(self, stage: int) -> bool:
        return self.ranks[stage] == self.rank

    def on(self, stage: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def begin(self) -> None:
        """Nothing: each process runs its stages in order on its current stream."""

    def send(self, stage: int, x: torch.Tensor) -> None:
        assert x.dtype == HANDOFF_DTYPE, x.dtype
        dst = self.ranks[stage + 1]
        if dst == self.rank:
            self.local[stage + 1] = x
            return
        sent = self.pending[stage]
        while sent and (len(sent) >= IN_FLIGHT or sent[0][0].is_completed()):
            sent.popleft()[0].wait()  # the oldest: done, or the receiver must catch up first
        x = x.contiguous()
        sent.append((self.dist.isend(x, dst=dst), x))
        self.link_bytes[stage] += x.numel() * x.element_size()

    def recv(self, stage: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if stage in self.local:
            return self.local.pop(stage)
        y = torch.empty(shape, dtype=HANDOFF_DTYPE, device=device)
        self.dist.recv(y, src=self.ranks[stage - 1])
        return y

    def logits(
        self, logits: torch.Tensor | None, shape: tuple[int, int], device: torch.device
    ) -> torch.Tensor:
        if shape[0] == 0:  # nothing to sample: no broadcast (the module docstring)
            return torch.empty(shape, dtype=torch.float32, device=device)
        out = torch.empty(shape, dtype=torch.float32, device=device) if logits is None else logits
        self.dist.broadcast(out.contiguous(), src=self.ranks[-1])
        return out

    def flush(self) -> None:
        """Wait for every send of this rank (before the process group goes)."""
        for sent in self.pending:
            while sent:
                sent.popleft()[0].wait()
