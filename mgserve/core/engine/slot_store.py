"""llama-server's slot save / restore / erase (``--slot-save-path``) over an engine.

``SlotStore`` is what the API calls: file names confined to one directory, each file written or
read off the event loop (``asyncio.to_thread``), the slot's state copied by the runner between
steps. ``SlotWaiters`` is the engine's side: an action waits for its slot (slot_actions.py), runs
as a step of its own, and that step's result answers it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from mgserve.core.engine import slot_file
from mgserve.core.engine.contract import (
    ScheduledBatch,
    SlotErase,
    SlotOp,
    SlotSave,
    SlotTensors,
    StepResult,
)
from mgserve.core.engine.slot_actions import SavedSlot, SlotAction, SlotActions

if TYPE_CHECKING:
    from mgserve.core.engine.actor import Engine

_FORBIDDEN = set('/\\:*?"<>|')  # separators, and what Windows refuses in a name (llama-server's)
_MAX_NAME = 255  # bytes


class SlotWaiters:
    """The slot actions an engine's clients wait on."""

    def __init__(self, actions: SlotActions, wake: asyncio.Event) -> None:
        self._actions, self._wake = actions, wake
        self._futures: dict[str, asyncio.Future[tuple[SlotOp, SlotTensors | None]]] = {}
        self._ids = itertools.count()
        self._closed = False

    async def run(
        self, slot: int, kind: str, saved: SavedSlot | None = None
    ) -> tuple[SlotOp, SlotTensors | None]:
        """Run ``kind`` on ``slot`` once it is idle: the op the runner ran and, for a save, the
        tensors it copied. Raises what the runner raised (ValueError: a state it refused)."""
        if self._closed:
            raise RuntimeError("the engine is stopped")
        aid = f"slot-action-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._futures[aid] = fut
        self._actions.add(SlotAction(aid, slot, kind, saved))  # type: ignore[arg-type]
        self._wake.set()
        try:
            return await fut
        finally:
            if self._futures.pop(aid, None) is not None:  # its client went away while it waited
                self._actions.cancel(aid)

    def settle(self, batch: ScheduledBatch, outcome: StepResult | Exception) -> None:
        """Answer the actions ``batch`` ran with its result (or the error it raised)."""
        for op in batch.slot_ops:
            fut = self._futures.pop(op.id, None)
            if fut is None or fut.done():
                continue
            if isinstance(outcome, Exception):
                fut.set_exception(outcome)
            else:
                fut.set_result((op, outcome.saved.get(op.id)))

    def close(self) -> None:
        self._closed = True
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the engine stopped"))


class SlotFileDone(NamedTuple):
    n_tokens: int  # tokens the slot held (saved) or holds now (restored)
    n_bytes: int  # the file's size
    ms: float  # the whole action: waiting for the slot, the copy and the file


class SlotStore:
    def __init__(self, engine: Engine, directory: str | Path, fingerprint: str) -> None:
        self.engine = engine
        self.directory = Path(directory).resolve()
        s = engine.settings
        self.identity = slot_file.SlotIdentity(
            fingerprint,
            str(engine.model.spec.arch),
            engine.slot_format,
            s.cache_type_k,
            s.cache_type_v,
        )

    def path(self, filename: str) -> Path:
        """``filename`` in the directory; ValueError for anything but a plain name there."""
        ok = (
            0 < len(filename.encode("utf-8", "replace")) <= _MAX_NAME
            and not _FORBIDDEN & set(filename)
            and all(ord(c) >= 0x20 and ord(c) != 0x7F for c in filename)
            and filename == filename.strip()
            and not filename.startswith(".")
            and not filename.endswith(".")
        )
        path = self.directory / filename
        if not ok or path.resolve().parent != self.directory:
            raise ValueError(f"invalid filename {filename!r}: a plain file name is expected")
        return path

    async def save(self, slot: int, filename: str) -> SlotFileDone:
        path = self.path(filename)
        t0 = time.perf_counter()
        op, tensors = await self.engine.slot_waiters.run(slot, "save")
        assert isinstance(op, SlotSave) and tensors is not None
        saved = SavedSlot(op.tokens, op.checkpoints, tensors, op.cuts)
        n_ctx = self.engine.n_ctx
        size = await asyncio.to_thread(slot_file.write, path, self.identity, n_ctx, saved)
        return SlotFileDone(len(op.tokens), size, (time.perf_counter() - t0) * 1e3)

    async def restore(self, slot: int, filename: str) -> SlotFileDone:
        """ValueError when there is no such file or it cannot be loaded here (slot_file.py)."""
        path = self.path(filename)
        t0 = time.perf_counter()
        try:
            saved, size = await asyncio.to_thread(
                slot_file.read, path, self.identity, self.engine.n_ctx
            )
        except FileNotFoundError:
            raise ValueError(f"no slot file {filename!r} in the slot save path") from None
        if any(t >= self.engine.model.spec.n_vocab for t in saved.tokens):
            raise ValueError(f"{filename} holds token ids outside the vocabulary")
        await self.engine.slot_waiters.run(slot, "restore", saved)
        return SlotFileDone(len(saved.tokens), size, (time.perf_counter() - t0) * 1e3)

    async def erase(self, slot: int) -> int:
        """The tokens the slot held."""
        op, _ = await self.engine.slot_waiters.run(slot, "erase")
        assert isinstance(op, SlotErase)
        return op.n
