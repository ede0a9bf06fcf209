"""Recurrent-state checkpoints: prefix reuse for models whose state cannot be cut back.

A Gated DeltaNet slot holds the state after exactly its history; a request sharing only part of
that history cannot start from it. A checkpoint is a copy of a slot's recurrent state (everything
that is not positional: DeltaNet and conv states, qwen4exp's PLE history and pending QSA keys) at
token position p. K/V (and QSA block keys) are positional in the slot, so loading the checkpoint
at p into the same slot and computing on from p gives exactly the state a cold run would have.

Checkpoints are taken at the end of prompt chunks, which for these models end on absolute
multiples of the batch size and of ``every``, and at the request's cut hints (message
boundaries the API found, ``Request.cut_hints``): at every multiple of ``every``, at every hint,
and at the last chunk end before the prompt's end (at most a chunk before ``len(prompt) - 1``,
the most a request may reuse, since the last prompt token is always recomputed for its logits).
So a second turn, an edited turn or a shared system prompt starts from the nearest one, only a
hint splits a step further, and a request restored from one cuts the rest of its prompt exactly
where a cold run does: it computes the cold run's bits (the chunked delta rule rounds differently
under another split; a session continued from its live state, past decoded tokens, agrees only
up to rounding). Hints are not multiples, so a state at ``p`` is the cold run's only for a
request with the same hints up to ``p``: each slot records the hints its state was computed
under (``Slot.cuts``), and a request reuses it only before the first hint where the two differ
(``agree``).

Two halves, one per side of the contract:

- ``CheckpointBook`` (the scheduler's, pure): which checkpoints exist, where they live, and the
  policy: at most ``per_slot`` per slot in device memory, the least recently used moved to host
  memory under a byte budget shared by all slots, the least recently used there dropped. Every
  decision becomes a ``CheckpointMove`` for the runner, so the runner never holds what the book
  forgot nor drops what it counts on.
- ``CheckpointStore`` (each runner's): the checkpoints themselves, saved, restored and moved
  through the model-specific functions the runner gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from mgserve.core.engine.contract import CheckpointMove, ScheduledBatch

T = TypeVar("T")


@dataclass
class _Entry:
    on_host: bool
    used: int  # tick of the last add or restore: the least recently used goes first


class CheckpointBook:
    def __init__(self, every: int, per_slot: int, host_bytes: int, nbytes: int) -> None:
        if per_slot < 0 or every < 0 or host_bytes < 0 or nbytes < 1:
            raise ValueError(f"bad checkpoint sizes: {every=} {per_slot=} {host_bytes=} {nbytes=}")
        self.every = every  # a checkpoint every `every` prompt positions (0: prompt ends only)
        self.per_slot = per_slot  # checkpoints per slot in device memory (0: none at all)
        self.host_bytes = host_bytes  # budget for those moved to host memory, all slots
        self.nbytes = nbytes  # one checkpoint
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._tick = 0
        self._moves: list[CheckpointMove] = []

    @classmethod
    def off(cls) -> CheckpointBook:
        """No checkpoints: a model whose state rewinds, or a recurrent one served without them."""
        return cls(0, 0, 0, 1)

    # -- what exists -----------------------------------------------------------------------------

    @property
    def held(self) -> dict[tuple[int, int], bool]:
        """(slot, position) -> in host memory, for every checkpoint the runner holds."""
        return {k: e.on_host for k, e in self._entries.items()}

    def best(self, slot: int, limit: int) -> int:
        """The latest checkpoint of ``slot`` at or before ``limit`` (0: none, start afresh)."""
        return max((p for s, p in self._entries if s == slot and p <= limit), default=0)

    def nbytes_in(self, host: bool) -> int:
        return self.nbytes * sum(e.on_host == host for e in self._entries.values())

    def cuts(self, hints: tuple[int, ...], n_prompt: int, batch_size: int) -> tuple[int, ...]:
        """The cuts ``hints`` add to a prompt's chunking: those inside it that are not multiples
        of ``batch_size`` or ``every`` already, sorted (none without checkpoints)."""
        if not self.per_slot:
            return ()
        grid = [n for n in (batch_size, self.every) if n]
        return tuple(sorted({h for h in hints if 0 < h < n_prompt and all(h % n for n in grid)}))

    def chunk_end(
        self, done: int, n_prompt: int, batch_size: int, cuts: tuple[int, ...] = ()
    ) -> tuple[int, bool]:
        """Where a prompt chunk computed from position ``done`` ends, and whether a checkpoint is
        taken there (``cuts``: the request's, from ``cuts()``). Without checkpoints:
        ``batch_size`` tokens on (or the prompt's end)."""
        if not self.per_slot:
            return min(done + batch_size, n_prompt), False
        end = self._boundary(done, batch_size, n_prompt, cuts)
        if end == n_prompt:
            return end, False
        last = self._boundary(end, batch_size, n_prompt, cuts) == n_prompt
        return end, last or end in cuts or (self.every > 0 and end % self.every == 0)

    def _boundary(self, pos: int, batch_size: int, n_prompt: int, cuts: tuple[int, ...]) -> int:
        """The first multiple of ``batch_size`` or ``every``, or cut, after ``pos``, at most
        ``n_prompt``."""
        ends = [(pos // n + 1) * n for n in (batch_size, self.every) if n]
        return min(*ends, *(c for c in cuts if c > pos), n_prompt)

    # -- the scheduler's decisions ---------------------------------------------------------------

    def add(self, slot: int, pos: int) -> None:
        """(slot, pos) will be taken after the step being planned; make room in device memory."""
        self._entries[(slot, pos)] = _Entry(on_host=False, used=self._tock())
        on_device = [k for k, e in self._entries.items() if k[0] == slot and not e.on_host]
        if len(on_device) <= self.per_slot:
            return
        victim = min(on_device, key=lambda k: self._entries[k].used)
        if self.nbytes > self.host_bytes:
            self._drop(victim)
            return
        self._entries[victim].on_host = True
        self._moves.append(CheckpointMove(*victim, to_host=True))
        while self.nbytes_in(host=True) > self.host_bytes:
            on_host = [k for k, e in self._entries.items() if e.on_host]
            self._drop(min(on_host, key=lambda k: self._entries[k].used))

    def keep(self, slot: int, n: int) -> None:
        """A request reuses the first ``n`` tokens of ``slot``: drop the checkpoints past them;
        the one at ``n``, if any (the request restores it), becomes the most recently used."""
        for key in [k for k in self._entries if k[0] == slot and k[1] > n]:
            self._drop(key)
        self.touch(slot, n)

    def touch(self, slot: int, pos: int) -> None:
        """(slot, pos), if held, is about to be read (restored or copied): the most recently
        used."""
        if (slot, pos) in self._entries:
            self._entries[(slot, pos)].used = self._tock()

    def replace(self, slot: int, positions: tuple[int, ...]) -> tuple[int, ...]:
        """A saved slot is loaded into ``slot``: its checkpoints replace the slot's in the runner
        (no moves), the latest ``per_slot`` of them in device memory. Returns those kept."""
        for key in [k for k in self._entries if k[0] == slot]:
            del self._entries[key]
        kept = tuple(sorted(positions)[-self.per_slot :]) if self.per_slot else ()
        for pos in kept:
            self._entries[(slot, pos)] = _Entry(on_host=False, used=self._tock())
        return kept

    def take_moves(self) -> tuple[CheckpointMove, ...]:
        """The moves decided since the last call, for the next batch."""
        moves, self._moves = tuple(self._moves), []
        return moves

    def _drop(self, key: tuple[int, int]) -> None:
        del self._entries[key]
        self._moves.append(CheckpointMove(*key, to_host=False))

    def _tock(self) -> int:
        self._tick += 1
        return self._tick


def agree(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first position where two cut lists differ (None: they are the same): a state computed
    under cuts ``a`` is the one cuts ``b`` compute only at positions before it."""
    return min(set(a) ^ set(b), default=None)


class CheckpointStore(Generic[T]):
    """A runner's checkpoints, keyed (slot, position). ``save(slot)`` copies a slot's recurrent
    state, ``load(slot, ckpt)`` writes one back, ``to_host(ckpt)`` moves one to host memory."""

    def __init__(
        self,
        save: Callable[[int], T],
        load: Callable[[int, T], None],
        to_host: Callable[[T], T],
    ) -> None:
        self._save, self._load, self._to_host = save, load, to_host
        self.held: dict[tuple[int, int], T] = {}

    def before(self, batch: ScheduledBatch) -> None:
        """Restores, then the book's moves: what the step does before its forward."""
        for w in batch.work:
            if w.restore:
                self._load(w.slot, self.get(w.slot, w.start))
        for m in batch.checkpoint_moves:
            ckpt = self.held.pop((m.slot, m.pos), None)  # None: its step failed, never taken
            if m.to_host and ckpt is not None:
                self.held[(m.slot, m.pos)] = self._to_host(ckpt)

    def get(self, slot: int, pos: int) -> T:
        ckpt = self.held.get((slot, pos))
        if ckpt is None:
            raise RuntimeError(f"no checkpoint of slot {slot} at position {pos}")
        return ckpt

    def of_slot(self, slot: int, positions: tuple[int, ...]) -> dict[int, T]:
        """The checkpoints of ``slot`` at ``positions`` (a slot save copies them)."""
        return {p: self.held[(slot, p)] for p in positions}

    def replace(self, slot: int, ckpts: dict[int, T]) -> None:
        """A loaded slot's checkpoints instead of those ``slot`` held (the book's ``replace``)."""
        for key in [k for k in self.held if k[0] == slot]:
            del self.held[key]
        self.held.update({(slot, p): c for p, c in ckpts.items()})

    def after(self, batch: ScheduledBatch) -> None:
        """The checkpoints the step's chunks end on."""
        for w in batch.work:
            if w.checkpoint:
                self.held[(w.slot, w.start + len(w.tokens))] = self._save(w.slot)
