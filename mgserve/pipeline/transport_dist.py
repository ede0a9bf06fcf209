"""``DistTransport``: a layer pipeline's stages in several processes (other hosts), joined by
``torch.distributed`` (gloo on the CPU, NCCL on GPUs); the ``Transport`` of transport.py.

A hand-off is a point-to-point send from the rank of stage i to the rank of stage i + 1. It is
sent without waiting (``isend``): the sender goes on with its next work (the next prompt chunk,
or the next micro-batch of a decode step's sessions) while the receiver still computes the one
before, which is what lets the stages of different processes run at once. A send's tensor is
kept until the send completes, and at most ``IN_FLIGHT`` sends per link are outstanding: the
next waits for the oldest, so a fast first stage runs at most that far ahead of its receiver (a
qwen4exp hand-off of a 4096-token chunk is 168 MB; on NCCL that bounds the first stage's GPU
stream, its host may run ahead further). Across processes the ranks agree on a step
by running the same ``ScheduledBatch`` (lockstep.py), so they need no other message for it.

The last stage's logits go to rank 0, which samples. The other ranks need them only where their
runners' state depends on the sampled tokens: a verify step of a recurrent model (``everyone``),
whose rejected drafts each rank rolls back from its own draws of the same logits, so there they
are broadcast to every rank. Elsewhere a rank's draws from zeros are thrown away: its penalty
window grows by the tokens of rank 0's next steps, not by its own draws. A step that wants no
logits (a prompt chunk before the prompt's last) sends nothing:
a broadcast, even of nothing, waits for every rank, and would hold the first stage until the
last has finished the chunk. Pipelined prefill is that: chunk c + 1 on stage 0 while chunk c is
on stage 1.

GPU tensors over gloo (two ranks sharing a GPU, which NCCL refuses, or a machine without NCCL)
cross through host memory: copied out before a send, received on the host and copied in.

Decode steps through CUDA graphs (graphs.py): nothing of torch.distributed can run inside a
capture, so a captured step's hand-offs are the graph's inputs and outputs (``GraphIO``): inside
the capture ``recv`` hands the stage a buffer of the graph's, ``send`` notes the tensor the
graph computes, and ``logits`` the logits; a replay is preceded by the receive into that buffer
(``before_replay``) and followed by the send of a copy of that tensor and the logits' broadcast
(``after_replay``), so every rank meets the others' sends, receives and broadcasts in the order
an eager step makes them. A replay receives all its micro-batches before it computes and sends
them after: through graphs, the stages of a decode step do not overlap across processes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mgserve.pipeline.transport import HANDOFF_DTYPE

IN_FLIGHT = 2  # outstanding sends per link (each holds its hand-off's tensor)
SAMPLER = 0  # the rank that samples (lockstep.py's rank 0)


@dataclass
class GraphIO:
    """A captured step's hand-offs (the module docstring): what the replay reads and writes."""

    received: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (stage, input)
    sent: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (stage, output)
    logits: torch.Tensor | None = None  # the graph's logits (another rank's: filled here)
    everyone: bool = True  # every rank takes them (else the sampler alone: ``logits``)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DistTransport:
    """Stages in several processes (the module docstring): ``ranks[i]`` is the rank that computes
    stage i; the process group is initialized."""

    def __init__(self, ranks: Sequence[int], rank: int | None = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.ranks, self.n_stages = list(ranks), len(ranks)
        self.rank = dist.get_rank() if rank is None else rank
        self.host_staged = dist.get_backend() == "gloo"  # GPU tensors cross through the host
        self.local: dict[int, torch.Tensor] = {}  # hand-offs between stages of this rank
        self.pending: list[deque[tuple[Any, torch.Tensor]]] = [
            deque() for _ in range(max(0, self.n_stages - 1) + 1)
        ]  # per link, then the logits' to the sampler: (work, tensor) of the sends in flight
        self.sent_bytes = [0] * max(0, self.n_stages - 1)  # bytes this rank sent on each link
        self.io: GraphIO | None = None  # the capture's, while one runs (``take_graph_io``)

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
        elif _capturing(x.device):
            self._io().sent.append((stage, x))
        else:
            self._isend(stage, x)

    def _isend(self, stage: int, x: torch.Tensor) -> None:
        self._isend_to(self.pending[stage], self.ranks[stage + 1], x)
        self.sent_bytes[stage] += x.numel() * x.element_size()

    def _isend_to(self, sent: deque[tuple[Any, torch.Tensor]], dst: int, x: torch.Tensor) -> None:
        while sent and (len(sent) >= IN_FLIGHT or sent[0][0].is_completed()):
            # the oldest: done (NCCL says so; gloo's work only once waited for), or the
            # receiver must catch up first
            sent.popleft()[0].wait()
        x = (x.to("cpu") if self.host_staged else x).contiguous()
        sent.append((self.dist.isend(x, dst=dst), x))

    def recv(self, stage: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if stage in self.local:
            return self.local.pop(stage)
        y = torch.empty(shape, dtype=HANDOFF_DTYPE, device=device)
        if _capturing(device):  # the graph's input: filled before each replay
            self._io().received.append((stage, y))
        else:
            self._recv_into(stage, y)
        return y

    def _recv_into(self, stage: int, y: torch.Tensor) -> None:
        self._recv_from(self.ranks[stage - 1], y)

    def _recv_from(self, src: int, y: torch.Tensor) -> None:
        if self.host_staged and y.is_cuda:
            host = torch.empty(y.shape, dtype=y.dtype)
            self.dist.recv(host, src=src)
            y.copy_(host)
        else:
            self.dist.recv(y, src=src)

    def logits(
        self, logits: torch.Tensor | None, shape: tuple[int, int], device: torch.device,
        everyone: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        if shape[0] == 0:  # nothing to sample: no broadcast (the module docstring)
            return torch.empty(shape, dtype=torch.float32, device=device)
        if logits is not None:
            out = logits
        elif everyone or self.rank == SAMPLER:
            out = torch.empty(shape, dtype=torch.float32, device=device)
        else:  # a middle rank's: zeros (each step's own: a sampler may write into its logits)
            out = torch.zeros(shape, dtype=torch.float32, device=device)
        if _capturing(device):
            io = self._io()
            io.logits, io.everyone = out, everyone
        else:
            self._deliver(out, everyone)
        return out

    def _deliver(self, out: torch.Tensor, everyone: bool) -> None:
        """The last stage's logits to every rank (``everyone``) or to the sampler alone."""
        if everyone:
            self._broadcast(out)
        else:
            self._to_sampler(out)

    def _to_sampler(self, out: torch.Tensor) -> None:
        """The last stage's logits to the sampler (rank 0) alone; another rank's are zeros."""
        last = self.ranks[-1]
        if last == SAMPLER:
            return
        if self.rank == last:
            self._isend_to(self.pending[-1], SAMPLER, out)
        elif self.rank == SAMPLER:
            self._recv_from(last, out)

    def _broadcast(self, out: torch.Tensor) -> None:
        src = self.ranks[-1]
        if self.host_staged and out.is_cuda:
            host = out.to("cpu")
            self.dist.broadcast(host, src=src)
            if self.rank != src:
                out.copy_(host)
        else:
            self.dist.broadcast(out, src=src)

    def _io(self) -> GraphIO:
        if self.io is None:
            self.io = GraphIO()
        return self.io

    def take_graph_io(self) -> GraphIO | None:
        """The hand-offs of the capture that just ended (graphs.py keeps them with its graph)."""
        io, self.io = self.io, None
        return io

    def before_replay(self, io: GraphIO) -> None:
        """The replayed step's input from the stage before, into the graph's buffer (received
        into memory of our own first: the graph's pool is not NCCL's to hold)."""
        for stage, y in io.received:  # a micro-batch each, in order
            got = torch.empty_like(y)
            self._recv_into(stage, got)
            y.copy_(got)

    def after_replay(self, io: GraphIO) -> None:
        """The replayed step's output to the next stage (a copy: the next replay rewrites the
        graph's), then its logits from the last stage (through a copy too)."""
        for stage, x in io.sent:
            self._isend(stage, x.clone())
        if io.logits is not None and (io.everyone or self.rank in (SAMPLER, self.ranks[-1])):
            out = io.logits.clone()
            self._deliver(out, io.everyone)
            if self.rank != self.ranks[-1]:
                io.logits.copy_(out)

    def before_capture(self) -> None:
        """No send of this rank in flight while a graph is captured (NCCL's watchdog queries its
        works' events, which a capture forbids): all done, on the host too."""
        self.flush()

    def flush(self) -> None:
        """Wait for every send of this rank, on the host (before a capture, or before the process
        group goes; on NCCL ``wait`` only orders the current stream, so the device is synced)."""
        gpu = False
        for sent in self.pending:
            while sent:
                work, x = sent.popleft()
                work.wait()
                gpu = gpu or x.is_cuda
        if gpu:
            torch.cuda.synchronize()
