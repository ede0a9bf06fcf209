"""Slot save / restore / erase on the scheduler's side (pure): an action waits for its slot to be
idle, then becomes one ``SlotOp`` for the runner, in a batch of its own.

As llama-server defers a slot task while the slot is processing, an action on a busy slot waits
for the request there; from the moment it is asked it holds the slot, so no request admitted after
it (pinned to that slot or not) takes the slot first. Once planned, the scheduler's records say
what the runner will hold after the op: a restore sets the slot's tokens and checkpoints, an erase
forgets them, a save records nothing.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import SlotErase, SlotLoad, SlotOp, SlotSave, SlotTensors
from mgserve.core.engine.slots import Slot


class SavedSlot(NamedTuple):
    """A slot's state as a save wrote it: its tokens, checkpoint positions, tensors and the hint
    cuts it was computed under (``Slot.cuts``)."""

    tokens: tuple[int, ...]
    checkpoints: tuple[int, ...]
    tensors: SlotTensors
    cuts: tuple[int, ...]


class SlotAction(NamedTuple):
    id: str
    slot: int
    kind: Literal["save", "restore", "erase"]
    saved: SavedSlot | None = None  # restore: what to load


class SlotActions:
    """The actions waiting for their slots, in the order they were asked."""

    def __init__(self) -> None:
        self._pending: list[SlotAction] = []

    def add(self, action: SlotAction) -> None:
        assert (action.kind == "restore") == (action.saved is not None), action.kind
        self._pending.append(action)

    def cancel(self, action_id: str) -> None:
        """Forget a waiting action (its client went away); one already planned runs."""
        self._pending = [a for a in self._pending if a.id != action_id]

    def holds(self, slot: int) -> bool:
        return any(a.slot == slot for a in self._pending)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(
        self, slots: list[Slot], book: CheckpointBook, step: int, held: set[int]
    ) -> SlotOp | None:
        """The first action whose slot is idle (and not ``held`` by a batch in flight), planned;
        None if every one still waits."""
        for i, action in enumerate(self._pending):
            slot = slots[action.slot]
            if slot.session is None and slot.id not in held:
                del self._pending[i]
                return _plan(action, slot, book, step)
        return None


def _plan(action: SlotAction, slot: Slot, book: CheckpointBook, step: int) -> SlotOp:
    if action.kind == "save":
        mine = tuple(sorted(p for s, p in book.held if s == slot.id))
        return SlotSave(action.id, slot.id, tuple(slot.cached), mine, slot.cuts)
    if action.kind == "erase":
        n = len(slot.cached)
        slot.cached.clear()
        book.keep(slot.id, -1)
        return SlotErase(action.id, slot.id, n)
    saved = action.saved
    assert saved is not None
    slot.cached[:] = saved.tokens
    slot.cuts = saved.cuts
    slot.last_used = step  # a restored cache is the last one to give up
    kept = book.replace(slot.id, saved.checkpoints)
    return SlotLoad(action.id, slot.id, saved.tokens, kept, saved.tensors)


def undo(op: SlotOp, slot: Slot, book: CheckpointBook) -> None:
    """The runner failed on ``op``: what a failed load leaves in the slot is unknown."""
    if isinstance(op, SlotLoad):
        slot.cached.clear()
        book.keep(slot.id, -1)
