"""Counters for kernels whose last CTA finishes the launch's work (route.cu's fused router: the
routing after every CTA's logits; moe.cu / moe_q8.cu's gate/up: the int8 rounding of each group of
32 rows after the CTAs that wrote them). Each CTA takes a ticket with an atomic add; the one that
takes the last resets the counter, so every counter is 0 before and after each launch, and a CUDA
graph replays the launches as they were captured.

Launches on one stream run one after another (with programmatic dependent launch too: a kernel
touches its counters only after its grid_wait), so they share counters; launches on two streams
may run at once, so each stream gets its own share. One buffer per backend, made with it (never
during a graph capture).
"""

from __future__ import annotations

import torch

TICKET_STREAMS = 16  # streams with a share; more: the callers take their unfused path
TICKET_SHARE = 16384  # int32 counters per stream


class Tickets:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf = torch.zeros(TICKET_STREAMS * TICKET_SHARE, dtype=torch.int32, device=device)
        self._share: dict[int, int] = {}  # stream handle -> share index

    def at(self, n: int) -> int | None:
        """The address of ``n`` counters for the current stream, or None where none are left
        (more than TICKET_SHARE counters, or more than TICKET_STREAMS streams)."""
        if n > TICKET_SHARE:
            return None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        i = self._share.get(stream)
        if i is None:
            if len(self._share) >= TICKET_STREAMS:
                return None
            i = self._share[stream] = len(self._share)
        return self.buf.data_ptr() + 4 * TICKET_SHARE * i
