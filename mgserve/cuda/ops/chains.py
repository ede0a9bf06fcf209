"""Chained decode rows: a speculation verify step (cuda/runner.py) gives a drafting session 1 + k
consecutive decode rows of its slot at consecutive positions, a *run*. Every op that keeps a
slot's recurrent state (DeltaNet conv and delta rule, the PLE conv, QSA pending keys) processes a
run's rows in order, row r seeing the state after rows 0..r-1, with the per-row arithmetic of the
single-row decode op: its outputs are bitwise those of r + 1 plain decode steps, and the slot's
state after the step is the state after the run's last row. A single row is a run of one.

``Chains`` describes the runs of a step as static-shape device tensors made on the host (so a
decode graph captures once per row count): per row, its run's length where the run starts (0
inside a run; the CUDA kernels loop over a run in the CTA of its first row), its index in the
run and the row index of the run's last row (the torch twins gather with them). ``longest`` is,
on the host, a bound on the runs' length: the torch delta rule loops that many times, and 1 keeps
every torch twin on its single-row code. An eager step knows its longest run; a decode graph's
buffers serve the steps of its bucket, so a graph for steps with runs has the bucket's row count
as the bound and a graph for plain steps 1 (graphs.py keeps the two apart). The CUDA kernels
loop on the device and need no bound.

The helpers are the torch twins' gathers: ``histories`` (a shift-register state such as a conv's
previous inputs, as it stands before each row) and ``pending_after`` (QSA's block of raw keys
indexed by position mod ratio, as it stands after each row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def has_runs(slots: list[int]) -> bool:
    """Whether some consecutive rows share their slot (form a run)."""
    return any(a == b for a, b in zip(slots, slots[1:], strict=False))


def runs_of(slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(runs, depth, last) of rows whose consecutive equal slots form runs (module docstring)."""
    n = len(slots)
    runs, depth, last = [0] * n, [0] * n, [0] * n
    i = 0
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[i]:
            j += 1
        runs[i] = j - i
        for r in range(i, j):
            depth[r], last[r] = r - i, j - 1
        i = j
    return runs, depth, last


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, queued on the current stream (through pinned memory on
    a GPU: no wait for the device)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Chains:
    runs: torch.Tensor  # [B] int32: at a run's first row its row count, 0 at the run's others
    depth: torch.Tensor  # [B] int32: the row's index in its run
    last: torch.Tensor  # [B] int32: the row index of the run's last row
    longest: int  # host: no run is longer (1: every row alone)

    @staticmethod
    def of(slots: list[int], device: torch.device) -> Chains:
        runs, depth, last = runs_of(slots)
        t = to_device(torch.tensor([runs, depth, last], dtype=torch.int32), device)
        return Chains(t[0], t[1], t[2], max(runs, default=1))

    @staticmethod
    def buffers(n: int, device: torch.device, runs: bool) -> Chains:
        """A graph's static buffers, every row alone until a replay fills them; ``runs``: its
        steps may have runs (of up to ``n`` rows)."""
        rows = torch.arange(n, dtype=torch.int32, device=device)
        return Chains(torch.ones_like(rows), torch.zeros_like(rows), rows, n if runs else 1)

    @property
    def alone(self) -> bool:
        """Every row is known to be a run of its own (the single-row code serves)."""
        return self.longest == 1

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's value of the run's last row: x [B, ...] -> [B, ...]."""
        return x.index_select(0, self.last.long())


def histories(state: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, c: Chains) -> torch.Tensor:
    """Each row's history before it [B, H, C]: the last H entries of its slot's ``state``
    [n_slots, H, C] followed by the inputs ``x`` [B, C] of the run's rows before it."""
    b, h = x.shape[0], state.shape[1]
    st = state.index_select(0, slots.long())  # [B, H, C]
    if h == 0:
        return st
    at = c.depth.long()[:, None] + torch.arange(h, device=x.device)[None]  # [B, H] in (state, x)
    from_state = st.gather(1, at.clamp(max=h - 1)[..., None].expand(-1, -1, st.shape[2]))
    first = torch.arange(b, device=x.device)[:, None] - c.depth.long()[:, None]  # run's first row
    from_x = x.index_select(0, (first + at - h).clamp(min=0).flatten()).view(b, h, -1)
    return torch.where((at >= h)[..., None], from_x, from_state)


def pending_after(
    pending: torch.Tensor, raw: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, c: Chains
) -> torch.Tensor:
    """Each row's QSA pending block after it [B, ratio, D]: entry e holds the raw key of the
    latest position q <= pos with q % ratio == e, from the run's rows where q is one of theirs,
    else from the slot's ``pending`` [n_slots, ratio, D] as the step found it."""
    b, r = raw.shape[0], pending.shape[1]
    p = pos.long()[:, None]  # [B, 1]
    q = p - torch.remainder(p - torch.arange(r, device=raw.device)[None], r)  # [B, ratio]
    back = p - q  # rows back from this one
    mine = back <= c.depth.long()[:, None]  # q is a row of this run
    row = (torch.arange(b, device=raw.device)[:, None] - back).clamp(min=0)
    from_raw = raw.index_select(0, row.flatten()).view(b, r, -1)
    old = pending.index_select(0, slots.long())
    return torch.where(mine[..., None], from_raw, old)
