"""The device runner's rollback of a recurrent model's state after a verify step (issue 13; the
reference runner's is core/engine/verify.py).

A verify step gives a drafting session 1 + k rows (x, d1, .., dk) at positions start .. start + k,
a run (ops/chains.py): the ops that keep recurrent state (DeltaNet conv and delta rule, the PLE
conv, QSA pending keys) take its rows in order, so the slot ends the step at the state after
row k and each row's logits are bitwise plain decode's. When the host accepts a < k drafts, the
session holds tokens x, d1 .. da (rows 0..a) and the state must be the one after row a.

The runner keeps (``keep``), before the forward, each drafting slot's recurrent state (a
checkpoint of it, snapshots.py: one device copy of ``SlotPools.recurrent`` and the model's host
state of the slot) and the forward logs, layer by layer, how to re-run its state updates from
their inputs (``Step.log``). After sampling, ``roll_back`` restores each rejected session's
state and re-runs the logged updates on its rows 0..a, all such sessions in one batch of runs:
the same kernels on the same inputs, so the state is bitwise the one a + 1 plain decode steps
leave. The PLE token history (host state) advances by the accepted tokens again. K/V rows and
QSA block keys past the accepted ones are positional: rewritten before anything reads them.
A session whose drafts were all accepted needs nothing. This is all queued on the step's stream
after the step's one synchronisation: no other wait.

Costs: a copy of the slot's recurrent state per drafting session and step, and on rejection a
copy back plus the recurrent ops of a + 1 rows; a decode graph keeps its logged inputs alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgserve.core.engine.contract import SeqResult, SeqWork
from mgserve.cuda import snapshots as snap
from mgserve.cuda.models.base import DeviceLM, Replay
from mgserve.cuda.ops.chains import Chains, to_device


@dataclass
class Kept:
    """A drafting session's state from before its verify step, to roll it back."""

    slot: int
    ckpt: snap.DeviceCheckpoint
    first: int  # the session's first row in the decode step
    tokens: tuple[int, ...]  # its 1 + k tokens


def check(model: DeviceLM, w: SeqWork) -> None:
    """ValueError for a verify entry this rollback cannot serve (before anything runs)."""
    if w.n_draft and not model.rewindable and w.checkpoint:
        raise ValueError(f"slot {w.slot}: drafts with a checkpoint (it would hold the drafts)")


def keep(model: DeviceLM, decode: list[SeqWork]) -> list[Kept]:
    """Before the forward: the state of each drafting session of ``decode`` (the decode step's
    work in row order) whose model cannot rewind by itself."""
    if model.rewindable:
        return []
    kept, row = [], 0
    for w in decode:
        if w.n_draft:
            kept.append(Kept(w.slot, snap.save(model, w.slot), row, tuple(w.tokens)))
        row += len(w.tokens)
    return kept


def roll_back(
    model: DeviceLM, kept: list[Kept], results: list[SeqResult], log: list[Replay],
    device: torch.device,
) -> None:  # fmt: skip
    """Put each kept session whose drafts were not all accepted (``results``: the step's, a
    session's accepted drafts and one token more) at the state after its accepted tokens
    (module docstring)."""
    accepted = {k.slot: -1 for k in kept}
    for res in results:
        if res.slot in accepted:
            accepted[res.slot] += 1
    back = [k for k in kept if accepted[k.slot] < len(k.tokens) - 1]
    if not back:
        return
    if not log:
        raise RuntimeError("a verify step to roll back, but the forward logged no state updates")
    rows: list[int] = []
    slots: list[int] = []
    for k in back:
        snap.load(model, k.slot, k.ckpt)  # the state (and host state) from before the step
        n = accepted[k.slot] + 1  # rows 0..a
        rows += range(k.first, k.first + n)
        slots += [k.slot] * n
    rows_t = to_device(torch.tensor(rows, dtype=torch.int64), device)
    slots_t = to_device(torch.tensor(slots, dtype=torch.int32), device)
    chains = Chains.of(slots, device)
    with model.backend.path.step("decode"):  # as the verify step ran them (ops/rowpath.py)
        for replay in log:
            replay(rows_t, slots_t, chains)
    for k in back:  # the host state (the PLE token history) past the accepted tokens again
        model.step_extra([list(k.tokens[: accepted[k.slot] + 1])], [k.slot])
