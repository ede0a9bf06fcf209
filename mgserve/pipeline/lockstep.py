"""``mgserve serve`` as a layer pipeline across processes: rank 0 serves HTTP and schedules as
one process does; every step its runner takes is first broadcast to the other ranks, which run
the same step through runners of their own, so the stages' sends and receives and the logits'
passing (``DistTransport``) meet in the same order everywhere. A follower takes the steps in a
thread of its own (``_listen``) and runs them in order, so rank 0 never waits for a busy
follower to take the next step: with the sends in flight and no broadcast for a chunk that
samples nothing (transport_dist.py), rank 0's stage computes chunk c + 1 of a long prompt while
rank 1's computes chunk c (pipelined prefill), and an eager decode step's micro-batches overlap.

Every rank loads its stage of the model (its layers and their state; the embedding on the first,
the head on the last: models/base.py) and builds the same ``DeviceRunner`` over a ``StagedLM`` of
one stage per rank (``ranks[i] = i``; the layers split by ``--tensor-split``, a share per rank,
or by decode weight bytes: ``process_ranges``); its memory plan is its stage's. Rank
0's runner is wrapped in a ``Leader``: ``run`` broadcasts the ``ScheduledBatch`` on the control
group (rendezvous.py), then runs it. A batch crosses as it is, but for two things: a new
session's sampling seed is drawn on rank 0 before it goes (where the other ranks get the logits,
at a recurrent model's verify step, they draw rank 0's tokens and accept its drafts, so they roll
back the same; elsewhere their draws are thrown away and their state follows rank 0's batches),
and a grammar stays on rank 0 (its matcher cannot cross; the others' masks do not
matter, as their tokens are thrown away and a grammar's session never drafts). The warm-up goes
through the same ``run``. When rank 0's engine stops (a ``LeaderEngine``; SIGTERM: after the
drain) the ``Leader`` broadcasts the stop, and the followers leave their loop and exit 0; they
ignore SIGTERM and SIGINT themselves (torchrun sends them to every rank at once, and rank 0's
drain still needs them; only once the ranks have agreed, so a rank still waiting for the others
stops on Ctrl-C). A step that fails on any rank ends the pipeline: the ranks' hand-offs would be
out of step (a rank stuck in a receive, or taking the next step's tensor for this one's), so a
follower whose step fails exits 1, and rank 0 exits 1 when its step or the broadcast before it
fails (the follower's exit closes its connections, so rank 0 sees it at its next step). A
supervisor (torchrun's restarts, compose's ``restart:``) starts them again.

A slot save or restore (``--slot-save-path``) runs on every rank, each for its stage's part of the
slot, and rank 0 writes or reads the one file: slots_dist.py. Not across processes (refused at
start, ``refuse``): ``--prefill-lane on`` (two threads' steps at once), ``--virtual-stages`` and
``--device-list``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import signal
import threading
from typing import Any, NamedTuple

import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import ScheduledBatch, StepResult
from mgserve.core.gguf.reader import GGUFFile
from mgserve.pipeline import slots_dist, stage_stats
from mgserve.pipeline.rendezvous import Rendezvous, agree

log = logging.getLogger(__name__)

STOP = None  # the control message that ends the followers
AHEAD = 4  # steps a follower takes from rank 0 before it has run them (``_listen``)


def refuse(settings: Settings) -> None:
    """ValueError for what does not run across processes (the module docstring)."""
    refused = {"--prefill-lane on": settings.prefill_lane == "on",
               "--virtual-stages": settings.virtual_stages > 1,
               "--device-list": settings.device_list is not None}  # fmt: skip
    named = [k for k, v in refused.items() if v]
    if named:
        raise ValueError(f"not supported across processes (--dist-*, torchrun): {', '.join(named)}")


class StageRunner(NamedTuple):
    runner: Any  # DeviceRunner over this rank's StagedLM
    model: Any  # the device model (its spec, pools)
    settings: Settings  # resolved for the model (ctx_size)


def stage_runner(g: GGUFFile, settings: Settings, device: str, rv: Rendezvous) -> StageRunner:
    """This rank's runner: its stage's layers loaded and run (the module docstring)."""
    from mgserve import env
    from mgserve.core.gguf.hparams import spec_from_gguf
    from mgserve.core.gguf.hparams_hybrid import HYBRID_ARCHS, hybrid_spec_from_gguf
    from mgserve.core.models import set_threads
    from mgserve.cuda.backend import cuda_backend, int8_activations, load_device_model
    from mgserve.cuda.plan_sizes import Part
    from mgserve.cuda.runner import DeviceRunner
    from mgserve.pipeline.staged import StagedLM, process_ranges
    from mgserve.pipeline.transport_dist import DistTransport
    from mgserve.settings_checks import with_batch

    spec = hybrid_spec_from_gguf(g)[0] if g.architecture in HYBRID_ARCHS else spec_from_gguf(g)
    settings = with_batch(settings.for_model(spec.n_ctx_train), gpu=device == "cuda")
    ranges = process_ranges(g, settings, rv.world_size, spec.n_layer)
    a, b = ranges[rv.rank]
    part = Part(a, b, a == 0, b == spec.n_layer)  # this rank loads only its stage
    if device == "cuda":
        from mgserve.cuda.plan_fit import checked_plan

        log.info("%s", checked_plan(g, settings, part))
        dev = torch.device("cuda", 0)
        int8 = int8_activations(g, settings.activations)
        backend = cuda_backend(0, int8=int8, cache_dir=env.cache_dir(settings.cache_dir))
    else:
        set_threads(settings.threads)
        if settings.activations == "int8":
            raise ValueError("--activations int8 is for the GPU runner (--device cuda)")
        from mgserve.cuda.backend import torch_backend

        dev, backend = torch.device("cpu"), torch_backend()
    kv = (settings.cache_type_k, settings.cache_type_v)
    model = load_device_model(g, backend, dev, settings.parallel, settings.ctx_size, *kv, part)
    transport = DistTransport(list(range(rv.world_size)), rv.rank)
    staged = StagedLM(model, ranges, transport, settings.pipeline_micro_batches)
    log.info("rank %d of %d: stage %d, layers %d-%d (%.2f GB of weights loaded)", rv.rank,
             rv.world_size, rv.rank, a, b - 1, model.weight_bytes / 1e9)  # fmt: skip
    gpu = dev.type == "cuda"  # decode graphs, hand-offs around each replay (transport_dist)
    return StageRunner(DeviceRunner(staged, dev, graphs=gpu), model, settings)


def _crossing(batch: ScheduledBatch) -> ScheduledBatch:
    """``batch`` with its new sessions' seeds drawn (it runs on rank 0 so too)."""
    from mgserve.cuda.sampling import seeded

    work = tuple(
        dataclasses.replace(w, sampling=seeded(w.sampling)) if w.new_sequence else w
        for w in batch.work
    )
    return dataclasses.replace(batch, work=work)


class Leader:
    """Rank 0's runner: each step broadcast to the other ranks, then run (module docstring)."""

    lanes = False

    def __init__(self, runner: Any, control: Any, state_bytes: int) -> None:
        self.inner = runner
        self.state_bytes = state_bytes  # the ranks' largest stage state per slot (``agree``)
        self.model = runner.model  # /metrics reads the staged model's per-stage figures
        self.control = control
        self.supports_drafts = runner.supports_drafts
        self.slot_format = slots_dist.slot_format(runner.slot_format, runner.model.ranges)
        self.slots = slots_dist.LeaderSlots(runner)  # its gloo group: as the followers make it
        world = len(runner.model.ranges)  # the other ranks' per-stage figures (stage_stats.py)
        runner.model.peers = stage_stats.Peers(world, stage_stats.group())
        self.closed = False

    @property
    def checkpoint_nbytes(self) -> int:  # the host-RAM budget's unit: the largest rank's part
        return self.state_bytes

    def run(self, batch: ScheduledBatch) -> StepResult:
        if self.closed:
            raise RuntimeError("the pipeline's followers have stopped")
        batch = _crossing(batch)
        sent = tuple(dataclasses.replace(w, grammar=None) if w.grammar else w for w in batch.work)
        try:
            if slots_dist.moves_state(batch):  # a slot save or restore: on every rank
                return self.slots.run(batch, self._send)
            self._send(dataclasses.replace(batch, work=sent))
            return self.inner.run(batch)  # type: ignore[no-any-return]
        except slots_dist.Refused:
            raise  # every rank agreed not to restore: the pipeline is in step (slots_dist.py)
        except Exception:  # the ranks are out of step, or one is gone (the module docstring)
            _fatal(f"rank 0: step {batch.step} failed; the pipeline cannot go on")
            raise  # not reached

    def _send(self, message: ScheduledBatch | None) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.control)

    def close(self) -> None:
        """Stop the followers (after the engine's last step) and leave the process group."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        flush = getattr(self.model.transport, "flush", None)
        if flush is not None:  # this rank's hand-offs in flight, before the group goes
            flush()
        self._send(STOP)
        if not self.model.peers.close(timeout=30):  # a thread in a receive would abort it
            log.warning("rank 0: a follower sent no last figures; leaving without teardown")
            return
        dist.destroy_process_group()
        log.info("rank 0: the pipeline's followers are told to stop")


class LeaderEngine(Engine):
    """Rank 0's engine: when it stops (its last step done), its ``Leader`` stops the others."""

    async def stop(self) -> None:
        await super().stop()
        assert isinstance(self._runner, Leader)
        await asyncio.get_running_loop().run_in_executor(None, self._runner.close)


def leader_engine(g: GGUFFile, settings: Settings, device: str, rv: Rendezvous) -> Engine:
    """Rank 0's engine: its runner a ``Leader`` over this rank's stage, warmed up through it."""
    from mgserve.cuda.warmup import warm_up
    from mgserve.pipeline.rendezvous import join
    from mgserve.spec import speculator_from

    if rv.rank != 0:
        raise ValueError(f"rank {rv.rank} follows rank 0: start it with `mgserve serve`")
    refuse(settings)
    control = join(rv, device)
    runner, model, settings = stage_runner(g, settings, device, rv)
    leader = Leader(runner, control, agree(control, settings, g, runner.checkpoint_nbytes))
    spec_k = settings.spec_k if settings.spec == "on" else 0
    warm_up(leader, model.spec.n_vocab, settings.ctx_size, settings.batch_size, spec_k)
    return LeaderEngine(model, settings, runner=leader, drafter=speculator_from(settings))


def _fatal(what: str) -> None:
    """Log ``what`` (with the exception being handled, if any) and end the process with 1 at
    once: torch.distributed's teardown with a peer gone or out of step may hang or abort."""
    log.critical(what, exc_info=True)
    logging.shutdown()
    os._exit(1)


def follow(settings: Settings, rv: Rendezvous, g: GGUFFile | None = None) -> int:
    """A rank other than 0: load (``g``, or the file the settings name), then run rank 0's steps
    until it stops; the exit status."""
    import torch.distributed as dist

    from mgserve.core.builtin_models import resolve_model
    from mgserve.cuda import resolve_device
    from mgserve.machine import choose_gpu
    from mgserve.pipeline.rendezvous import join, local_gpu

    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank {rv.rank} %(name)s: %(message)s",
    )
    refuse(settings)
    if settings.device != "cpu":  # before CUDA starts, as the factory does for rank 0
        local_gpu(rv)
        choose_gpu()
    device = resolve_device(settings.device)
    control = join(rv, device)
    g = g or GGUFFile(resolve_model(settings.model, settings.cache_dir))
    runner, _, resolved = stage_runner(g, settings, device, rv)
    agree(control, resolved, g, runner.checkpoint_nbytes)
    slots = slots_dist.group()  # as rank 0's Leader makes it
    # a failed send of figures: rank 0 is gone, as after a failed step (the module docstring)
    report = stage_stats.Reporter(runner.model.timing, rv.rank, stage_stats.group(), _fatal)
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0's stop ends this rank (docstring)
        signal.signal(sig, signal.SIG_IGN)
    log.info("rank %d: following rank 0's steps", rv.rank)
    steps = 0
    inbox: queue.Queue[Any] = queue.Queue(AHEAD)
    threading.Thread(target=_listen, args=(control, inbox, rv.rank), daemon=True).start()
    while True:
        try:
            batch = inbox.get(timeout=stage_stats.IDLE_AFTER)
        except queue.Empty:  # idle: this rank's last figures to rank 0 (stage_stats.py)
            report.idle()
            continue
        if batch is STOP:
            break
        try:
            if slots_dist.moves_state(batch):
                slots_dist.follow(runner, batch, slots)
            else:
                runner.run(batch)
        except Exception:  # the hand-offs would be out of step (the module docstring)
            _fatal(f"rank {rv.rank}: step {batch.step} failed; the pipeline cannot go on")
        steps += 1
        report.after_step()
    flush = getattr(runner.model.transport, "flush", None)
    if flush is not None:
        flush()
    report.close()
    dist.destroy_process_group()
    log.info("rank %d: rank 0 stopped after %d steps; exiting", rv.rank, steps)
    return 0


def _listen(control: Any, inbox: queue.Queue[Any], rank: int) -> None:
    """The follower's control channel, read in a thread of its own: rank 0's broadcast of a step
    waits for every rank to take it, so a follower busy computing an earlier step would hold rank
    0 (and the pipeline's first stage) until it is done. Up to ``AHEAD`` steps wait here."""
    import torch.distributed as dist

    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control)
        except BaseException as e:  # noqa: BLE001 - a dead listener would hang the main thread
            _fatal(f"rank {rank}: rank 0 is gone ({e})")
        inbox.put(box[0])
        if box[0] is STOP:
            return
