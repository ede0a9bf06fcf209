"""Counters for kernels whose last CTA finishes the launch's work (route.cu's fused router: the
routing after every CTA's logits; moe_q8.cu's gate/up: the int8 rounding of each group of 32 rows
after the CTAs that wrote them). Each CTA takes a ticket with an atomic add; the one that takes
the last resets the counter, so every counter is 0 before and after each launch, and a CUDA graph
replays the launches as they were captured.

Counters belong to a weight (a layer's router, its experts' gate/up) and a host thread: one
thread's launches of one layer never run at once (a decode step's layers run in order on one
stream, captured and replayed by the decoder's thread; pipeline stages hold other layers), while
two threads' may (the prefill lane runs a prompt's last token through the decode kernels, on its
own stream, beside the decoder's graphs). One buffer per backend, made with it (never during a
graph capture), handed out in order; a weight that needs more counters than it had gets a new
run of them.
"""

from __future__ import annotations

import threading

import torch

# int32 counters per backend (4 MB); qwen4exp takes 384 a thread (8 a router), 77,000 more with
# moe.round_h (1,600 a layer)
TICKETS = 1 << 20


class Tickets:
    def __init__(self, device: torch.device, size: int = TICKETS) -> None:
        self.device = device
        self.buf = torch.zeros(size, dtype=torch.int32, device=device)
        # (weight key, thread) -> (first counter, counters)
        self._runs: dict[tuple[int, int], tuple[int, int]] = {}
        self._used = 0
        self._lock = threading.Lock()
        # tickets.cuh's TICKET_ACQREL in the kernels that take them (the fused router, the int8
        # gate/up): one acq_rel atomic a CTA where three fences were. H100 (2026-12-07, bench
        # model --paired 5 --toggle route.tickets.acq_rel): one session +0.9% (every round
        # ahead), five sessions +0.5% (within the noise); the same bits
        self.acq_rel = True

    @property
    def defines(self) -> tuple[tuple[str, str], ...]:
        """The -D macros of tickets.cuh for the kernels that take these counters."""
        return (("TICKET_ACQREL", "1"),) if self.acq_rel else ()

    def at(self, key: int, n: int) -> int | None:
        """The address of ``n`` counters of the weight ``key`` (its bytes' address) for this
        thread, or None where the buffer has no ``n`` left (the caller takes its unfused path)."""
        k = (key, threading.get_ident())
        with self._lock:
            run = self._runs.get(k)
            if run is None or run[1] < n:
                if self._used + n > self.buf.numel():
                    return None
                run = self._runs[k] = (self._used, n)
                self._used += n
        return self.buf.data_ptr() + 4 * run[0]
