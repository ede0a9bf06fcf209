"""Counters for kernels whose last CTA finishes the launch's work (route.cu's fused router: the
routing after every CTA's logits; moe_q8.cu's gate/up: the int8 rounding of each group of 32 rows
after the CTAs that wrote them). Each CTA takes a ticket with an atomic add; the one that takes
the last resets the counter, so every counter is 0 before and after each launch, and a CUDA graph
replays the launches as they were captured.

Counters belong to a weight (a layer's router, its experts' gate/up): launches of one layer never
run at once (a decode step's layers run in order on one stream; pipeline stages hold other layers;
the prefill lane runs prompt chunks, which take the GEMMs), while launches of two layers may (two
virtual stages on one GPU). One buffer per backend, made with it (never during a graph capture),
handed out in order; a weight that needs more counters than it had gets a new run of them.
"""

from __future__ import annotations

import torch

TICKETS = 1 << 20  # int32 counters per backend (4 MB): qwen4exp's 48 layers take about 80,000


class Tickets:
    def __init__(self, device: torch.device, size: int = TICKETS) -> None:
        self.device = device
        self.buf = torch.zeros(size, dtype=torch.int32, device=device)
        self._runs: dict[int, tuple[int, int]] = {}  # weight key -> (first counter, counters)
        self._used = 0

    def at(self, key: int, n: int) -> int | None:
        """The address of ``n`` counters of the weight ``key`` (its bytes' address), or None
        where the buffer has no ``n`` left (the caller takes its unfused path)."""
        run = self._runs.get(key)
        if run is None or run[1] < n:
            if self._used + n > self.buf.numel():
                return None
            run = self._runs[key] = (self._used, n)
            self._used += n
        return self.buf.data_ptr() + 4 * run[0]
