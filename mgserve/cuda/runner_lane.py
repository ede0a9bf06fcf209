"""A lane of the device runner (cuda/runner.py): the CUDA stream its steps run on, the pinned
buffers its sampled ids come back through, the event a step's one wait is on, and how far its
host may run ahead of the GPU (``pace``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgserve.cuda.sampling import HostBuffers


@dataclass
class Lane:
    """What one lane has to itself (runner.py's module docstring says why)."""

    stream: torch.cuda.Stream | None  # None: the caller's current stream
    host: HostBuffers
    done: torch.cuda.Event | None  # None off the GPU
    ahead: torch.cuda.Event | None = None  # the end of its last step that waited for nothing

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
