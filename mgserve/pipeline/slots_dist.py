"""Slot save and restore (``--slot-save-path``) in a pipeline across processes (lockstep.py):
each rank holds its stage's part of a slot (the K/V rows and QSA block keys of its layers, its
layers' recurrent state and checkpoints, packed as one process packs them: cuda/snapshots.py),
and rank 0 alone writes and reads the slot file.

One file per slot, written by rank 0, a tensor of stage r named ``stage<r>.<name>`` (``name`` as
one process names it: ``k.<layer>``, ``state``, ``ckpt.<pos>.state``, ...). The runner's
``slot_format``, which a file records and slot_file.py checks, names the split (``slot_format``:
``device, pipeline of 2 processes: layers 0-1, 2-3``): a file saved by a pipeline of another
split or world size, or by one process, gets a 400 naming the file and both (a one-process
server refuses a pipeline's file so too). One file rather than a part per rank beside it: the
slot is whole under one name, written by one rename (a save that fails on a rank leaves nothing,
and no stale part of an older save can pair with a newer one), and only rank 0's directory is
used (other hosts need no shared one). The cost: rank 0 holds the whole slot in host memory
while it saves or restores it (as one process does), and the other stages' parts cross once.

The parts cross on a gloo group of their own (``group``: every rank makes it right after
``agree``), not the control group, where a follower's listener may already wait for the next
step. Rank 0 broadcasts the batch as any step (a restore's tensors left out), then:

- a restore: rank 0 sends each follower its stage's tensors; every rank checks its own against
  its slot without writing (``snapshots.check_slot``), the followers send rank 0 their answers,
  and rank 0 broadcasts the verdict. All fit: every rank runs the batch. Else every rank runs
  it without its loads (freed slots and checkpoint moves still apply everywhere) and rank 0
  raises ``Refused`` with the ranks' reasons: a 400 for the client, the slot left empty on rank
  0's books (scheduler ``undo``), the pipeline in step and serving on;
- a save: every rank runs the batch; each follower sends rank 0 its tensors (a table, then each
  tensor's bytes), which returns them all as the op's (``SlotStore`` writes the file).

A failure of the messages themselves (a rank gone) ends the pipeline, as a failed step does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mgserve.core.engine.contract import (
    ScheduledBatch,
    SlotLoad,
    SlotSave,
    SlotTensors,
    StepResult,
)

Tensors = dict[str, dict[str, torch.Tensor]]  # op id -> name -> tensor


class Refused(ValueError):
    """A restore every rank agreed not to run (a rank's part does not fit its slot)."""


def moves_state(batch: ScheduledBatch) -> bool:
    """Whether ``batch`` saves or restores a slot (an erase needs nothing of the ranks)."""
    return any(isinstance(op, SlotSave | SlotLoad) for op in batch.slot_ops)


def slot_format(runner_format: str, ranges: Sequence[tuple[int, int]]) -> str:
    layers = ", ".join(f"{a}-{b - 1}" for a, b in ranges)
    return f"{runner_format}, pipeline of {len(ranges)} processes: layers {layers}"


def group() -> Any:
    """The slot parts' gloo group; every rank makes it at the same point (after ``agree``)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _prefix(stage: int) -> str:
    return f"stage{stage}."


def _loads(batch: ScheduledBatch) -> list[SlotLoad]:
    return [op for op in batch.slot_ops if isinstance(op, SlotLoad)]


def _with(batch: ScheduledBatch, parts: Mapping[str, SlotTensors] | None) -> ScheduledBatch:
    """``batch`` with its loads' tensors ``parts[op.id]``; None: without its loads."""
    ops = tuple(
        op._replace(tensors=parts[op.id]) if isinstance(op, SlotLoad) and parts is not None else op
        for op in batch.slot_ops
        if parts is not None or not isinstance(op, SlotLoad)
    )
    return dataclasses.replace(batch, slot_ops=ops)


def _check(runner: Any, batch: ScheduledBatch) -> str | None:
    """Why this rank's parts of ``batch``'s loads do not fit its slots; None if they do."""
    from mgserve.cuda import snapshots

    try:
        for op in _loads(batch):
            snapshots.check_slot(runner.model, op, runner.new_host_state)
    except ValueError as e:
        return str(e)
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _send(tensors: Tensors, dst: int, grp: Any) -> None:
    """``tensors`` to rank ``dst``: their table, then each one's bytes."""
    import torch.distributed as dist

    flat = [(op, name, t) for op, ts in tensors.items() for name, t in ts.items()]
    table = [(op, name, t.dtype, tuple(t.shape)) for op, name, t in flat]
    dist.send_object_list([table], dst=dst, group=grp)
    for _, _, t in flat:
        if t.numel():
            dist.send(_bytes(t), dst=dst, group=grp)


def _recv(src: int, grp: Any) -> Tensors:
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=grp)
    out: Tensors = {}
    for op, name, dtype, shape in box[0]:
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            dist.recv(_bytes(t), src=src, group=grp)
        out.setdefault(op, {})[name] = t
    return out


def _split(batch: ScheduledBatch, ranges: Sequence[tuple[int, int]]) -> tuple[list[Tensors], str]:
    """The loads' tensors by stage (``stage<r>.`` taken off), and what names no stage here."""
    stages: list[Tensors] = [{op.id: {} for op in _loads(batch)} for _ in ranges]
    stray = ""
    for op in _loads(batch):
        for name, t in op.tensors.items():
            r = next((r for r in range(len(ranges)) if name.startswith(_prefix(r))), None)
            if r is None:
                stray = stray or f"the saved state has {name!r}, which no stage here holds"
            else:
                stages[r][op.id][name.removeprefix(_prefix(r))] = t
    return stages, stray


def _joined(stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One op's tensors of every stage, named ``stage<r>.<name>``."""
    return {_prefix(r) + name: t for r, ts in enumerate(stages) for name, t in ts.items()}


class LeaderSlots:
    """Rank 0's side (the module docstring): ``runner`` runs its stage."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.ranges: list[tuple[int, int]] = list(runner.model.ranges)
        self.group = group()

    def run(self, batch: ScheduledBatch, broadcast: Callable[[ScheduledBatch], None]) -> StepResult:
        """``batch`` (slot saves or restores) on every rank; ``broadcast`` sends it to the
        others on the control group. Raises ``Refused`` for a restore a rank cannot load."""
        import torch.distributed as dist

        broadcast(_with(batch, {op.id: {} for op in _loads(batch)}))
        refused = None
        if _loads(batch):
            stages, stray = _split(batch, self.ranges)
            for r in range(1, len(self.ranges)):
                _send(stages[r], r, self.group)
            mine = _with(batch, stages[0])
            why = [stray or _check(self.runner, mine)]
            for r in range(1, len(self.ranges)):
                box: list[Any] = [None]
                dist.recv_object_list(box, src=r, group=self.group)
                why.append(box[0])
            refused = "; ".join(self._whose(r, w) for r, w in enumerate(why) if w) or None
            dist.broadcast_object_list([refused is None], src=0, group=self.group)
            batch = _with(batch, None) if refused else mine
        result = self.runner.run(batch)
        saves = [op for op in batch.slot_ops if isinstance(op, SlotSave)]
        if saves:
            every = [{op.id: dict(result.saved[op.id]) for op in saves}]
            every += [_recv(r, self.group) for r in range(1, len(self.ranges))]
            result.saved = {op.id: _joined([ts.get(op.id, {}) for ts in every]) for op in saves}
        if refused:
            raise Refused(refused)
        return result  # type: ignore[no-any-return]

    def _whose(self, rank: int, why: str) -> str:
        a, b = self.ranges[rank]
        return f"rank {rank} (layers {a}-{b - 1}): {why}"


def follow(runner: Any, batch: ScheduledBatch, grp: Any) -> None:
    """A follower's side of a batch that ``moves_state`` (the module docstring)."""
    import torch.distributed as dist

    if _loads(batch):
        got = _recv(0, grp)
        mine = _with(batch, {op.id: got.get(op.id, {}) for op in _loads(batch)})
        dist.send_object_list([_check(runner, mine)], dst=0, group=grp)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=grp)
        batch = mine if box[0] else _with(batch, None)
    result = runner.run(batch)
    saves = [op for op in batch.slot_ops if isinstance(op, SlotSave)]
    if saves:
        _send({op.id: dict(result.saved[op.id]) for op in saves}, 0, grp)
