"""The engine actor: one asyncio task that owns the scheduler and drives the runner.

Messages come in through an inbox (``_Submit``, ``_Abort``); token events go out through each
request's ``RequestStream``. Per step: drain the inbox, plan, run the step in a worker thread (the
event loop never waits on the model), apply the result, deliver events. With nothing to do the
task sleeps on the inbox. A step that raises fails only the requests it carried; the engine keeps
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

from mgserve.config import Settings
from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import Request, ScheduledBatch, StepResult, TokenEvent
from mgserve.core.engine.metrics import Counter, Gauge, Histogram, Registry
from mgserve.core.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Runner(Protocol):
    def run(self, batch: ScheduledBatch) -> StepResult: ...

    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of one recurrent-state checkpoint (0: the model's state rewinds)."""
        ...


class _Submit(NamedTuple):
    req: Request
    t_submit: float


class _Abort(NamedTuple):
    request_id: str


class RequestStream:
    """Async iterator of one request's ``TokenEvent``s; ends after the one with a finish_reason."""

    def __init__(self, request_id: str, engine: Engine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._finished = False  # the final event was handed to the reader
        self._aborted = False
        self.t_submit = time.monotonic()
        self.t_last = self.t_submit  # last token delivered, for the inter-token latency

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._finished:
            raise StopAsyncIteration
        ev = await self._events.get()
        if ev.finish_reason is not None:
            self._finished = True
        return ev

    def abort(self) -> None:
        """Free the request's slot; iteration ends with an "abort" event (if not finished first)."""
        if not self._aborted:
            self._aborted = True
            self._engine._inbox.put_nowait(_Abort(self.request_id))


class Engine:
    """Serves ``settings.parallel`` slots of ``settings.ctx_size`` tokens each over one model.

    ``settings`` come resolved for the model (``Settings.for_model``). ``runner`` defaults to the
    CPU ``ReferenceRunner``; the device runner plugs in the same way (``factory.py`` picks).
    """

    def __init__(self, model: Any, settings: Settings, *, runner: Runner | None = None) -> None:
        self.settings = settings
        self.n_slots = settings.parallel
        self.n_ctx = settings.ctx_size
        self.model = model
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
        self._sched = Scheduler(
            self.n_slots,
            self.n_ctx,
            settings.batch_size,
            rewindable=model.rewindable,
            checkpoints=book,
        )
        self._inbox: asyncio.Queue[_Submit | _Abort] = asyncio.Queue()
        self._streams: dict[str, RequestStream] = {}  # open requests
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mgserve-runner")
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

        self._metrics = Registry()
        m = self._metrics
        self._m_prompt = m.add(
            Counter("mgserve_prompt_tokens_total", "prompt tokens processed (cache hits excluded)")
        )
        self._m_cached = m.add(
            Counter(
                "mgserve_prompt_tokens_cached_total", "prompt tokens reused from a slot's cache"
            )
        )
        self._m_gen = m.add(Counter("mgserve_generated_tokens_total", "tokens generated"))
        self._m_req = m.add(
            Counter("mgserve_requests_total", "finished requests", label="finish_reason")
        )
        m.add(Gauge("mgserve_slots_busy", "slots serving a request", lambda: self._sched.n_busy))
        m.add(Gauge("mgserve_slots_total", "slots", lambda: self.n_slots))
        m.add(
            Gauge(
                "mgserve_requests_queued",
                "requests waiting for a slot",
                lambda: len(self._sched.queue),
            )
        )
        self._m_ttft = m.add(
            Histogram("mgserve_time_to_first_token_seconds", "submit to first generated token")
        )
        self._m_itl = m.add(
            Histogram("mgserve_inter_token_latency_seconds", "between consecutive tokens")
        )
        self._m_step = m.add(Histogram("mgserve_step_seconds", "one model step on the runner"))
        self._m_restores = m.add(
            Counter("mgserve_checkpoint_restores_total", "recurrent-state checkpoints restored")
        )
        for tier, host in (("device", False), ("host", True)):
            m.add(
                Gauge(
                    f"mgserve_checkpoint_{tier}_bytes",
                    f"recurrent-state checkpoints held in {tier} memory",
                    lambda host=host: self._sched.checkpoints.nbytes_in(host),  # type: ignore[misc]
                )
            )

    # -- the API side ----------------------------------------------------------------------------

    def submit(self, req: Request) -> RequestStream:
        """Queue a request checked at the API boundary (``contract.Request``); its events follow."""
        if self._stopped:
            raise RuntimeError("the engine is stopped")
        if req.id in self._streams:
            raise ValueError(f"request id {req.id!r} is already in use")
        stream = RequestStream(req.id, self)
        self._streams[req.id] = stream
        self._inbox.put_nowait(_Submit(req, stream.t_submit))
        return stream

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
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        for rid in list(self._streams):
            ev = self._sched.abort(rid) or TokenEvent(rid, None, finish_reason="abort")
            self._deliver([ev])

    def slots(self) -> list[dict[str, Any]]:
        return self._sched.slot_info()

    def metrics_text(self) -> str:
        return self._metrics.render()

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "total_slots": self.n_slots,
            "n_ctx": self.n_ctx,
            "busy_slots": self._sched.n_busy,
            "queued": len(self._sched.queue),
            "prompt_tokens_total": int(self._m_prompt.value()),
            "generated_tokens_total": int(self._m_gen.value()),
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
        while True:
            while not self._inbox.empty():
                self._handle(self._inbox.get_nowait())
            batch = self._sched.schedule()
            if batch is None:
                self._handle(await self._inbox.get())  # idle: sleep until a message arrives
                continue
            self._m_restores.inc(sum(w.restore for w in batch.work))
            try:
                result = await loop.run_in_executor(self._executor, self._runner.run, batch)
            except Exception as e:
                log.exception("step %d failed", batch.step)
                events = self._sched.fail(batch.step, f"{type(e).__name__}: {e}")
            else:
                self._m_step.observe(result.seconds)
                events = self._sched.apply(result)
            self._deliver(events)

    def _handle(self, msg: _Submit | _Abort) -> None:
        if isinstance(msg, _Submit):
            self._sched.add(msg.req, msg.t_submit)
        else:
            ev = self._sched.abort(msg.request_id)
            if ev is not None:
                self._deliver([ev])

    def _deliver(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if ev.token is not None:
                self._m_gen.inc()
                if ev.n_generated == 1:
                    self._m_ttft.observe(now - stream.t_submit)
                    self._m_prompt.inc(ev.n_prompt - ev.n_cached)
                    self._m_cached.inc(ev.n_cached)
                else:
                    self._m_itl.observe(now - stream.t_last)
                stream.t_last = now
            if ev.finish_reason is not None:
                self._m_req.inc(label=ev.finish_reason)
                del self._streams[ev.request_id]
            stream._events.put_nowait(ev)
