"""A lane of the device runner (cuda/runner.py): the CUDA stream its steps run on, the pinned
buffers its sampled ids come back through, its sampling inputs' batches (sampling/kept.py), the
event a step's one wait is on, and how far its host may run ahead of the GPU: by steps
(``pace``) and, in the prefill lane, by layers within a prompt chunk (``LaunchWindow``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from mgserve.cuda.sampling import HostBuffers, SamplingBatch
from mgserve.cuda.sampling.kept import SizeClass

LAYERS_AHEAD = 2  # the prefill lane waits after each layer for the end of the one this far back


@dataclass
class Lane:
    """What one lane has to itself (runner.py's module docstring says why)."""

    stream: torch.cuda.Stream | None  # None: the caller's current stream
    host: HostBuffers
    done: torch.cuda.Event | None  # None off the GPU
    ahead: torch.cuda.Event | None = None  # the end of its last step that waited for nothing
    layers_ahead: int = 0  # a prompt chunk's LaunchWindow depth (0: no window)
    sampling: dict[SizeClass, SamplingBatch] = field(default_factory=dict)  # kept.py's batches

    def window(self) -> LaunchWindow | None:
        """A prompt chunk's ``LaunchWindow`` in this lane (None: unbounded)."""
        return LaunchWindow(self.layers_ahead) if self.layers_ahead and self.done else None

    def sync(self) -> None:
        if self.done is not None:
            self.done.record()
            self.done.synchronize()
            self.ahead = None

    def pace(self) -> None:
        """After a step that waited for nothing (no token sampled): wait for the end of the last
        such step, so the host stays at most one step ahead of the GPU and a step's seconds take
        in what the GPU still had of the one before (their sum is the wall time: metrics)."""
        if self.done is None:
            return
        end = torch.cuda.Event()
        end.record()
        if self.ahead is not None:
            self.ahead.synchronize()
        self.ahead = end


class LaunchWindow:
    """Bounds a thread's queued GPU work by layers: after each layer's launches, ``mark``
    records an event and waits for the one ``depth`` layers back, so at most ``depth + 1``
    layers are queued (``depth`` after the wait, and the next one's launches).

    Why: CUDA queues a bounded number of launches, and the queue is the GPU's, not a stream's.
    The prefill lane's thread launches a prompt chunk (thousands of kernels) far faster than the
    GPU runs them; unbounded, it fills the queue, and then every launch waits, the decoders'
    included, until the chunk's head has run (on the H100 the decoders' thread stopped for
    96-134 ms inside one launch, beside a lane chunk: tests/cuda/test_device_lanes.py). Two
    layers queued keep the GPU fed (a layer's launches take a fraction of its GPU time) while
    the queue keeps room for the decoders. The wait releases the GIL."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a launch window holds at least one layer, got {depth}")
        self.depth = depth
        self.marks: deque[torch.cuda.Event] = deque()

    def mark(self) -> None:
        end = torch.cuda.Event()
        end.record()
        self.marks.append(end)
        if len(self.marks) > self.depth:
            self.marks.popleft().synchronize()
