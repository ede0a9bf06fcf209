"""The engine actor: one asyncio task that owns the scheduler and drives the runner.

``submit`` and ``abort`` act on the scheduler at once (the event loop is the only thread that
touches it, the runner works on the batch it was handed): a request is queued, or refused with
``QueueFull`` when --max-queue requests already wait for a slot; an aborted request leaves its
slot or the queue before the next step is planned, and a result still on the runner for it is
dropped as stale. Per step: plan, run the step in a worker thread (the event loop never waits on
the model), apply the result, deliver events, and tell the scheduler how long all that took (its
prefill pacing, pacing.py, fits step times). With nothing to do the task sleeps until a submit
wakes it. A step that raises fails only the requests it carried; the engine keeps serving.
Slot save / restore / erase (``slot_waiters``) are planned by the scheduler as steps of their own.
With a runner that has ``lanes`` (lanes.py) the actor keeps two batches in flight, each in a
worker thread of its own: the decoders' and the prefill lane's; it plans the next of a kind as
soon as the last one is applied, so decoders get a token every decode step while a prompt chunk
is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from mgserve.config import Settings
from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import Request, ScheduledBatch, StepResult, TokenEvent
from mgserve.core.engine.drafting import Drafter
from mgserve.core.engine.lanes import LaneScheduler
from mgserve.core.engine.metrics import EngineMetrics
from mgserve.core.engine.scheduler import Scheduler
from mgserve.core.engine.slot_store import SlotWaiters
from mgserve.core.engine.stream import QueueFull, RequestStream
from mgserve.settings_checks import with_batch

log = logging.getLogger(__name__)

RETRY_AFTER_MAX_S = 60  # the longest Retry-After a refused request is told


class Runner(Protocol):
    def run(self, batch: ScheduledBatch) -> StepResult: ...

    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of one recurrent-state checkpoint (0: the model's state rewinds)."""
        ...

    slot_format: str  # the layout of a saved slot's tensors (slot files record it)
    # optional ``lanes``: True if ``run`` takes a lane batch in one thread beside a decode batch
    # in another (lanes.py); optional ``supports_drafts``: True if it verifies SeqWork.n_draft


class Engine:
    """Serves ``settings.parallel`` slots of ``settings.ctx_size`` tokens each over one model.

    ``settings`` come resolved for the model (``Settings.for_model``). ``runner`` defaults to the
    CPU ``ReferenceRunner``; the device runner plugs in the same way (``factory.py`` picks).
    ``drafter`` (speculation) is used only with a runner whose ``supports_drafts`` is True.
    """

    def __init__(
        self,
        model: Any,
        settings: Settings,
        *,
        runner: Runner | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.settings = settings = with_batch(settings, gpu=False)  # 0 the factory left: the CPU's
        self.n_slots, self.n_ctx, self.model = settings.parallel, settings.ctx_size, model
        if runner is None:
            from mgserve.core.engine.runner import ReferenceRunner

            runner = ReferenceRunner(
                model, self.n_slots, self.n_ctx, settings.cache_type_k, settings.cache_type_v
            )
        self._runner = runner
        book = None
        if not model.rewindable and settings.ctx_checkpoints:
            book = CheckpointBook(
                max(settings.checkpoint_every, 0),
                settings.ctx_checkpoints,
                settings.cache_ram << 20,
                runner.checkpoint_nbytes,
            )
        self.cut_hints = book is not None  # prompts are cut at Request.cut_hints (checkpoints.py)
        self.lanes: bool = getattr(runner, "lanes", False)
        if self.lanes and settings.itl_target_ms:
            log.info("--itl-target-ms is not used: prompt chunks run in the prefill lane")
        self._sched = (LaneScheduler if self.lanes else Scheduler)(
            self.n_slots,
            self.n_ctx,
            settings.batch_size,
            rewindable=model.rewindable,
            checkpoints=book,
            itl_target=0.0 if self.lanes else settings.itl_target_ms / 1e3,
            prefill_sessions=settings.prefill_sessions,
            prefix_copy=settings.prefix_copy_min,
            drafter=drafter if getattr(runner, "supports_drafts", False) else None,
        )
        self.max_queue = settings.max_queue
        self._wake = asyncio.Event()  # set by submit: the idle actor has work
        self.slot_waiters = SlotWaiters(self._sched.actions, self._wake)
        self._streams: dict[str, RequestStream] = {}  # open requests
        self._slot_s: float | None = None  # moving average of the seconds a request holds a slot
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mgserve-runner")
        self._lane_executor = ThreadPoolExecutor(1, thread_name_prefix="mgserve-lane")
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        spec = getattr(self._sched.spec.drafter, "stats", None)  # mgserve.spec's SpecStats
        self.metrics = EngineMetrics(self._sched, lambda: self.waiting, spec, runner)

    # -- the API side ----------------------------------------------------------------------------

    def submit(self, req: Request) -> RequestStream:
        """Queue a request checked at the API boundary (``contract.Request``); its events follow.
        ``QueueFull`` when --max-queue requests already wait for a slot."""
        if self._stopped:
            raise RuntimeError("the engine is stopped")
        if req.id in self._streams:
            raise ValueError(f"request id {req.id!r} is already in use")
        if self._waiting(len(self._sched.queue) + 1) > self.max_queue:  # it would wait: room?
            self.metrics.rejected += 1
            raise QueueFull(self.waiting, self._retry_after())
        stream = RequestStream(req, self._abort)
        self._streams[req.id] = stream
        self._sched.add(req, stream.t_submit)
        self.metrics.submitted += 1
        self._wake.set()
        return stream

    @property
    def waiting(self) -> int:
        """Requests queued beyond the free slots (those the next step admits do not wait; one
        pinned to a busy slot while others are free is not counted)."""
        return self._waiting(len(self._sched.queue))

    def _waiting(self, n_queued: int) -> int:
        return max(0, n_queued - (self.n_slots - self._sched.n_busy))

    def _retry_after(self) -> int:
        # a place frees when the next running request ends: about a slot's holding time / slots
        held = self._slot_s or 0.0
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(held / self.n_slots)))

    def _abort(self, request_id: str, finish_reason: str) -> None:
        ev = self._sched.abort(request_id, finish_reason)
        if ev is not None:
            self._deliver([ev])

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="mgserve-engine")

    async def stop(self) -> None:
        """Stop the actor, wait for a step still on the runner, end every open request."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        loop = asyncio.get_running_loop()
        for ex in (self._executor, self._lane_executor):
            await loop.run_in_executor(None, ex.shutdown)
        self.slot_waiters.close()
        for rid in list(self._streams):
            ev = self._sched.abort(rid) or TokenEvent(rid, None, finish_reason="abort")
            self._deliver([ev])

    def slots(self) -> list[dict[str, Any]]:
        return self._sched.slot_info()

    @property
    def slot_format(self) -> str:
        return self._runner.slot_format

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "total_slots": self.n_slots,
            "n_ctx": self.n_ctx,
            "busy_slots": self._sched.n_busy,
            "queued": self.waiting,
            "prompt_tokens_total": self.metrics.prompt_tokens,
            "generated_tokens_total": self.metrics.predicted_tokens,
        }

    # -- the actor -------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the engine itself: fail everyone rather than hang them
            log.exception("engine loop crashed")
            self._stopped = True
            for rid in list(self._streams):
                self._deliver([TokenEvent(rid, None, finish_reason="error", error=repr(e))])

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        running: dict[asyncio.Future[StepResult], tuple[ScheduledBatch, int, float]] = {}
        while True:
            busy = {b.lane for b, _, _ in running.values()}
            for lane in (True, False) if self.lanes else (False,):
                if lane in busy:
                    continue
                t0 = time.monotonic()  # a step's time, as its decoders see it: planned to delivered
                sched = self._sched
                batch = (
                    sched.schedule_lane()
                    if isinstance(sched, LaneScheduler) and lane
                    else sched.schedule()
                )
                if batch is None:
                    continue
                n_prompt = self._n_prompt(batch)
                self._deliver(self._started(batch))
                ex = self._lane_executor if lane else self._executor
                running[loop.run_in_executor(ex, self._runner.run, batch)] = (batch, n_prompt, t0)
            if not running:
                self._wake.clear()  # no await since schedule(): no submit was missed
                await self._wake.wait()
                continue
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                self._finish(fut, *running.pop(fut))

    def _finish(
        self, fut: asyncio.Future[StepResult], batch: ScheduledBatch, n_prompt: int, t0: float
    ) -> None:
        """Apply a step's result (or its failure: only its requests fail) and deliver events."""
        try:
            result = fut.result()
        except Exception as e:
            log.exception("step %d failed", batch.step)
            events = self._sched.fail(batch.step, f"{type(e).__name__}: {e}")
            self.slot_waiters.settle(batch, e)
        else:
            self.metrics.prefix_copies += len(batch.prefix_copies)
            if batch.work:  # a slot save / restore / erase is a step of its own
                self.metrics.on_step(batch, n_prompt, result)
            events = self._progress(batch) + self._sched.apply(result)
            self.slot_waiters.settle(batch, result)
        self._deliver(events)
        self._sched.observe(batch.step, time.monotonic() - t0)

    def _started(self, batch: ScheduledBatch) -> list[TokenEvent]:
        """Note the requests whose first work this is; 0% progress for those that want it."""
        events = []
        for w in batch.work:
            stream = self._streams.get(w.request_id)
            if w.new_sequence and stream is not None:
                stream.started(w.start)
                self.metrics.on_started(w.start)
                if stream.req.progress:
                    events.append(stream.progress(w.slot, w.start))
        return events

    def _n_prompt(self, batch: ScheduledBatch) -> int:
        """The step's prompt tokens, read from the sessions just planned (no await since)."""
        n = 0
        for w in batch.work:
            session = self._sched.slots[w.slot].session
            assert session is not None
            n += len(w.tokens) if w.start < len(session.req.prompt) else 0
        return n

    def _progress(self, batch: ScheduledBatch) -> list[TokenEvent]:
        """Progress after the step's prompt chunks, for the requests that want it."""
        events = []
        for w in batch.work:
            stream = self._streams.get(w.request_id)
            if stream is not None and stream.req.progress and w.start < len(stream.req.prompt):
                events.append(stream.progress(w.slot, w.start + len(w.tokens)))
        return events

    def _deliver(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if ev.token is not None:
                self.metrics.on_token(ev.n_generated == 1, now - stream.t_last)
                stream.t_last = now
            if ev.finish_reason is not None:
                self.metrics.on_finish(ev.finish_reason)
                del self._streams[ev.request_id]
                if stream.t_start is not None:
                    held, avg = now - stream.t_start, self._slot_s
                    self._slot_s = held if avg is None else avg + (held - avg) / 8
            stream._events.put_nowait(ev)
