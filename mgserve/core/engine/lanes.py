"""The prefill lane (``--prefill-lane``: on, or auto where it helps): prompt chunks computed
beside decode steps.

Without the lane a step carries the decoders' tokens and a prompt chunk, and its decoders wait for
the chunk. With it, the scheduler plans two kinds of batches, each in flight on its own:

- the decoders' batches (``schedule``): one token for each session past its prompt, one batch
  after another, nothing else (no admissions, slot ops, checkpoint moves or freed slots);
- the lane's batches (``schedule_lane``, when the lane's last batch is applied): the slot ops,
  else the admissions and the prompt chunks, in whole ``batch_size`` chunks cut where the
  sequential scheduler cuts them (the pacer is off: a chunk no longer delays decoders), with the
  book's moves, the prefix copies and the freed slots. A chunk stays in flight across as many
  decode batches as it takes.

A session is in one lane at a time: its prompt in the lane's batches, then its tokens in the
decoders'. The checkpoint store, the slot ops and the prefix copies are the lane's alone, so they
keep the sequential order among themselves and no decode batch touches them. A slot a batch in
flight computes on (an aborted session's too) takes no other request, lends nothing and is freed
for the runner only once that batch is applied (``_held``), so two lanes never write
one slot; a decoding session lends its K/V rows (the positions below its length, which its decode
batches never write) and its checkpoints, not its live state (placement.py). Each lane
computes what it would compute sequentially (the runner keeps decode rows on the decode kernels
and prompt rows on the prompt path), so the tokens are the same; only when they come changes.

A runner that runs the two kinds at once says so with ``lanes = True`` (cuda/runner.py: two CUDA
streams, the decoders' at high priority); the engine actor (actor.py) then keeps one batch of each
in flight.
"""

from __future__ import annotations

from typing import Any

from mgserve.core.engine.contract import ScheduledBatch
from mgserve.core.engine.scheduler import Scheduler


class LaneScheduler(Scheduler):
    """The scheduler with a prefill lane (see the module docstring); its pacer is off."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.placer.live_decoders = False

    def _held(self) -> set[int]:
        """Slots a batch in flight computes on (it may run beside the next): they take no
        request, lend nothing and are not freed for the runner until it is applied."""
        return {w.slot for b in self._in_flight.values() for w in b.work}

    def schedule(self) -> ScheduledBatch | None:
        """The decoders' next batch: one token each for sessions past their prompt, not in
        flight; None if there are none."""
        work = self.spec.decode_work(self, self._ready(False))
        return self._batch(tuple(work), (), chores=False) if work else None

    def schedule_lane(self) -> ScheduledBatch | None:
        """The lane's next batch, once its last one is applied: a slot op, else prompt chunks
        (admitting queued requests first); None if there is nothing to compute."""
        op = self.actions.take(self.slots, self.checkpoints, self._step, self._held())
        if op is not None:
            return self._batch((), (op,), lane=True)
        self._admit()
        work = self._prompt_work(self._ready(True), self.batch_size)
        if not work:
            return None
        return self._batch(tuple(sorted(work, key=lambda w: w.slot)), (), lane=True)
