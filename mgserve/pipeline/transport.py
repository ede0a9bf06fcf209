"""How a layer pipeline's stages hand a step's activations to the next one (``Transport``).

A step's hand-off from stage i to stage i + 1 is one float32 tensor [N, *handoff_shape] (the
residual stream of its N tokens: 4 x hidden for qwen4exp's hyper-connection streams); the last
stage's logits go to whoever samples. ``staged.py`` drives a transport; there are two:

- ``LocalTransport``: every stage in this process (``--virtual-stages``, or several GPUs of one
  host). On a GPU each stage computes on a CUDA stream of its own, and a hand-off goes through
  pinned host staging buffers, two per link used in turn (double-buffered: step s + 1's copy out
  may start while step s's copy in still reads the other): the device-to-host copy on the link's
  out stream after the sender's work (an event), the host-to-device copy on the link's in stream
  after that one (an event), the receiving stage's stream after it (an event), and a buffer is
  written again only after its last copy in (an event). No host wait anywhere. On the CPU the
  same hand-off is a real copy through the staging buffer. A step may be captured into a CUDA
  graph (the decode graphs, graphs.py): the capture takes in the stage and link streams (they wait
  on the capturing stream), its copies read and write the staging buffers it saw, which are kept
  for the graph's life (a larger step takes new ones beside them), and a replay is ordered after
  everything before it on the replaying stream, so it waits on no event recorded outside it
  (within it, a micro-batch's copy out waits for the copy in that last read its buffer). Peer
  copies between GPUs that reach each other are not written yet. ``LinkThrottle`` slows each
  link to a given rate, so one GPU's virtual stages see the links of another machine.
- ``DistTransport`` (transport_dist.py): stages in other processes (other hosts), over
  ``torch.distributed`` point-to-point sends and receives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

HANDOFF_DTYPE = torch.float32


class Transport(Protocol):
    n_stages: int

    def runs(self, stage: int) -> bool:
        """Whether this process computes ``stage``."""
        ...

    def on(self, stage: int) -> contextlib.AbstractContextManager[None]:
        """Where ``stage``'s work is issued (its CUDA stream; nothing off the GPU)."""
        ...

    def begin(self) -> None:
        """A step starts (its inputs are ready on the caller's stream)."""
        ...

    def send(self, stage: int, x: torch.Tensor) -> None:
        """Hand ``stage``'s output x to stage + 1."""
        ...

    def recv(self, stage: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``stage``'s input, handed off by stage - 1."""
        ...

    def logits(
        self, logits: torch.Tensor | None, shape: tuple[int, int], device: torch.device,
        everyone: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """The last stage's logits [R, V] where the caller samples (``logits``: this process's,
        None when another process ran the last stage); the caller's stream waits for them.
        ``everyone``: every process needs them (else only the one that samples: the others get
        logits whose draws they throw away)."""
        ...


class LinkThrottle:
    """Hand-offs no faster than given link rates, so virtual stages on one GPU see the links of a
    machine we do not have (the seed's x8/x4/x2 PCIe hops): after a hand-off's copies its link
    waits bytes / rate more before the receiving stage may start, on a GPU a spinning kernel on
    the link's stream (``torch.cuda._sleep``, its cycles per second measured once; a graph
    captures it), on the CPU the host sleeps. The real copies through host memory take their own
    time besides."""

    def __init__(self, gbps: Sequence[float], links: int, device: torch.device) -> None:
        rates = list(gbps) * links if len(gbps) == 1 else list(gbps)
        if len(rates) != links or any(r <= 0 for r in rates):
            raise ValueError(f"link rates {list(gbps)}: one rate > 0 for all or one per link "
                             f"({links})")  # fmt: skip
        self.rates = [r * 1e9 for r in rates]  # bytes per second
        self.gpu = device.type == "cuda"
        self.cycles_per_s = _sleep_rate(device) if self.gpu else 0.0

    def delay(self, link: int, nbytes: int) -> None:
        """The wait of ``nbytes`` on ``link``, on the current stream (GPU) or now (CPU)."""
        seconds = nbytes / self.rates[link]
        if self.gpu:
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))
        else:
            time.sleep(seconds)


def _sleep_rate(device: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on ``device`` (timed once with events)."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 1 << 24
        torch.cuda._sleep(cycles)  # the first launch loads the kernel
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


class LocalTransport:
    """Every stage in this process, on one device (the module docstring); ``link_gbps``: the
    links' rates in GB/s (``LinkThrottle``), none by default."""

    def __init__(self, n_stages: int, device: torch.device,
                 link_gbps: Sequence[float] | None = None) -> None:  # fmt: skip
        self.n_stages, self.device = n_stages, device
        self.gpu = device.type == "cuda"
        links = n_stages - 1
        self.throttle = LinkThrottle(link_gbps, links, device) if link_gbps else None
        none = torch.empty(0, dtype=HANDOFF_DTYPE)  # each buffer is made at its first hand-off
        self.buffers: list[list[torch.Tensor]] = [[none, none] for _ in range(links)]
        self.turn = [0] * links  # the buffer a link's next hand-off takes
        self.sent: list[tuple[int, int]] = [(0, 0)] * links  # (buffer, elements) in flight
        self.link_bytes = [0] * links  # bytes each link has carried (a first per-link metric)
        self.kept: list[torch.Tensor] = []  # replaced staging buffers a captured graph uses
        self.captured: set[int] = set()  # the staging buffers (data pointers) graphs use
        self.captured_reads: dict[tuple[int, int], torch.cuda.Event] = {}  # (link, buffer)
        if self.gpu:
            self.streams = [torch.cuda.Stream(device) for _ in range(n_stages)]
            self.out_streams = [torch.cuda.Stream(device) for _ in range(links)]
            self.in_streams = [torch.cuda.Stream(device) for _ in range(links)]
            self.written = [[torch.cuda.Event() for _ in range(2)] for _ in range(links)]
            self.read = [[torch.cuda.Event() for _ in range(2)] for _ in range(links)]
            self.used = [[False, False] for _ in range(links)]
            self.arrived = [torch.cuda.Event() for _ in range(links)]
            self.last_written = [torch.cuda.Event() for _ in range(links)]  # the latest send's

    def runs(self, stage: int) -> bool:
        return True

    @contextlib.contextmanager
    def on(self, stage: int) -> Iterator[None]:
        if not self.gpu:
            yield
            return
        with torch.cuda.stream(self.streams[stage]):
            yield

    def begin(self) -> None:
        if self.gpu:
            self.captured_reads = {}  # this step's, if it is captured
            caller = torch.cuda.current_stream(self.device)
            for s in self.streams:  # the step's inputs, and whatever ran before it
                s.wait_stream(caller)

    def _staging(self, link: int, k: int, n: int) -> torch.Tensor:
        if self.buffers[link][k].numel() < n:  # a larger step (a prompt chunk) than before
            # both of the link's buffers: the eager forward before a capture sizes the buffer
            # the capture takes too (no pinned allocation inside a capture)
            for kk, old in enumerate(self.buffers[link]):
                if old.numel() < n:
                    if old.data_ptr() in self.captured:  # a graph reads or writes it
                        self.kept.append(old)
                    self.buffers[link][kk] = torch.empty(n, dtype=HANDOFF_DTYPE,
                                                         pin_memory=self.gpu)  # fmt: skip
        buf = self.buffers[link][k]
        if self._capturing():
            self.captured.add(buf.data_ptr())
        return buf[:n]

    def _capturing(self) -> bool:
        return self.gpu and torch.cuda.is_current_stream_capturing()

    def send(self, stage: int, x: torch.Tensor) -> None:
        assert x.dtype == HANDOFF_DTYPE, x.dtype
        link, n = stage, x.numel()
        k = self.turn[link]
        self.turn[link] ^= 1
        self.sent[link] = (k, n)
        capturing = self._capturing()
        if not capturing:  # a graph's replays count theirs (StagedLM.replayed)
            self.link_bytes[link] += n * x.element_size()
        if not self.gpu:
            self._staging(link, k, n).copy_(x.reshape(-1))
            return
        out = self.out_streams[link]
        out.wait_stream(self.streams[stage])  # x is computed
        if capturing:  # a micro-batch before, in this capture, read the buffer: after its read
            read = self.captured_reads.get((link, k))
            if read is not None:
                out.wait_event(read)
        elif self.used[link][k]:  # the buffer's previous copy in has read it
            out.wait_event(self.read[link][k])
        with torch.cuda.stream(out):
            self._staging(link, k, n).copy_(x.reshape(-1), non_blocking=True)
            # in a capture, an event of its own: the persistent ones keep their real recordings
            written = torch.cuda.Event() if capturing else self.written[link][k]
            written.record(out)
            self.last_written[link] = written
        x.record_stream(out)  # x's memory is not reused before the copy has read it

    def recv(self, stage: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        link = stage - 1
        k, n = self.sent[link]
        if not self.gpu:
            if self.throttle is not None:
                self.throttle.delay(link, n * HANDOFF_DTYPE.itemsize)
            return self._staging(link, k, n).clone().view(shape)
        capturing = self._capturing()
        inn = self.in_streams[link]
        inn.wait_event(self.last_written[link])
        with torch.cuda.stream(inn):
            y = torch.empty(shape, dtype=HANDOFF_DTYPE, device=device)
            y.view(-1).copy_(self._staging(link, k, n), non_blocking=True)
            if self.throttle is not None:  # the emulated link's time, after the copies
                self.throttle.delay(link, n * HANDOFF_DTYPE.itemsize)
            arrived = torch.cuda.Event() if capturing else self.arrived[link]
            if capturing:  # events of the capture's own (a replay follows all before it)
                self.captured_reads[link, k] = read = torch.cuda.Event()
                read.record(inn)
            else:
                self.read[link][k].record(inn)
                self.used[link][k] = True
            arrived.record(inn)
        here = torch.cuda.current_stream(device)  # the receiving stage's (``on``)
        here.wait_event(arrived)
        y.record_stream(here)
        return y

    def logits(
        self, logits: torch.Tensor | None, shape: tuple[int, int], device: torch.device,
        everyone: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        assert logits is not None
        if self.gpu:
            caller = torch.cuda.current_stream(device)
            caller.wait_stream(self.streams[-1])
            logits.record_stream(caller)
        return logits
