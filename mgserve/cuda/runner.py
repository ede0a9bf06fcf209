"""The device runner: executes a ``ScheduledBatch`` on a device model and samples on the device.

The twin of ``mgserve/core/engine/runner.py`` (same contract, ``Engine(runner=...)``). One step:

1. prompt chunks (and first tokens at position 0) run as one eager prefill step;
2. decoding sessions' tokens (drafts too) run as one decode step, a CUDA-graph replay of their
   row count's bucket on a GPU (``graphs.py``);
3. the logits of every row that samples go through the device sampler together, and the token ids
   come back through pinned memory behind ONE event, the only host-device synchronisation of the
   step (DESIGN.md). A step that samples nothing (a prompt chunk) waits instead for the end of
   the last such step (``Lane.pace``): the host launches a chunk while the GPU ends the one
   before, and a step's seconds (the metrics' prompt time) still add up to the wall time.

Sessions keep their state in the model's ``SlotPools`` (slot-indexed); the runner keeps, per
running slot, what sampling needs on the host: the penalty window, the draw counter and, under a
grammar, the matcher whose mask is computed while the device runs the step's forward. A forced
token (``SeqWork.force``) is a mask of that one token, through the same path. A recurrent
model's checkpoints (``snapshots.py``) are restored before the forward and taken after it, in the
order the scheduler's book gives (core/engine/checkpoints.py); a slot save or restore copies a
whole slot between steps (``snapshots.save_slot`` / ``load_slot``; a save's copies run on a
stream of their own, save_stream.py, and a later step writing that slot waits for them); a prefix
copy from one slot to another is queued first in its step (``snapshots.copy_prefix``).

Speculation (``SeqWork.n_draft``): a session's 1 + k tokens become 1 + k decode rows of its slot
at consecutive positions, in the same decode step (graph) as everyone else's rows. A decode step
writes every row's K/V before any row attends, and each row attends up to its own position, so
row i sees exactly what the i-th of k + 1 plain decode steps would, and decode kernels compute
each row alone (batch-invariant): its logits are bitwise the plain decode's. Each row samples with
plain decode's draw counter and penalty window; the host accepts while the sampled token is the
next draft. A KV cache rewinds by itself (later rows are rewritten before read); a recurrent
state takes a session's rows in order (a run, ops/chains.py) and rolls back by verify.py.

With ``lanes`` (``--prefill-lane``, core/engine/lanes.py) ``run`` takes the prefill lane's
batches in one thread beside the decoders' in another. Each lane has a ``Lane`` of its own: a
CUDA stream (the decoders' at the highest priority, the prompts' at the lowest, so a decode step's
kernels get SMs first as a chunk's blocks retire) and the pinned buffers and event its sampled ids
come through. The decode graphs (their memory pool, static inputs and padding rows in the spare
slot) are the decoders' alone: a prompt's last token in the prefill lane takes the same decode
kernels eagerly, on its own row. A lane batch ends with its stream synchronized, so its result
(and a slot's state, before the session decodes) is complete when it returns. Scratch buffers
are per stream (``LinearCuda.scratch``), the row path per thread (ops/rowpath.py); a graph is
captured only while the lane is idle (a capture forbids other threads' allocations and syncs):
``_capture`` orders it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import torch

from mgserve.core.engine.checkpoints import CheckpointStore
from mgserve.core.engine.contract import (
    MAX_N_PROBS,
    SamplingParams,
    ScheduledBatch,
    SeqResult,
    SeqWork,
    SlotLoad,
    SlotSave,
    SlotTensors,
    StepResult,
    TopLogprob,
)
from mgserve.core.grammar import ForcedToken, Isolated, TokenMask, failures
from mgserve.cuda import snapshots as snap
from mgserve.cuda import verify
from mgserve.cuda.graphs import BUCKETS, DRAFT_BUCKETS, DecodeInputs, EagerDecode, GraphDecode
from mgserve.cuda.green import green_stream
from mgserve.cuda.models.base import DeviceLM, Span, Step
from mgserve.cuda.ops.chains import to_device
from mgserve.cuda.runner_lane import LAYERS_AHEAD, Lane, LaunchWindow
from mgserve.cuda.sampling import DeviceSampler, HostBuffers, SamplingRow, seeded
from mgserve.cuda.sampling.kept import kept_batch
from mgserve.cuda.save_stream import SaveStream


@dataclass
class _SlotSampling:
    params: SamplingParams  # with a seed (drawn once on the host when the request had none)
    history: list[int] = field(default_factory=list)  # the tokens the penalty window may read
    counter: int = 0  # draws made so far: (seed, counter) names the next draw's noise
    matcher: Isolated | None = None  # under a grammar: its mask fills the session's row


class DeviceRunner:
    supports_drafts = True  # verifies SeqWork.n_draft drafts, recurrent models too (verify.py)

    def __init__(
        self,
        model: DeviceLM,
        device: torch.device,
        *,
        graphs: bool = True,
        buckets: tuple[int, ...] = BUCKETS + DRAFT_BUCKETS,
        lanes: bool = False,
        lane_sms: int = 0,  # the prefill lane's SMs (a green context; 0: all, shared)
    ) -> None:
        self.model = model
        self._max_rows = buckets[-1]
        self.device = device
        self.lanes = lanes  # run a lane batch and a decode batch at once, from two threads
        self.pad_slot = model.pools.n_slots - 1  # the spare slot: padding rows of graph buckets
        model.begin_sequence(self.pad_slot)  # the shape of a slot's host state (load_slot)
        self.new_host_state = model.host_state(self.pad_slot)
        gpu = device.type == "cuda"
        extra = getattr(model, "decode_extra_shape", None)
        self._decoders = self._lane(-100)  # the top priority; before the graphs (green.py's ops)
        self._prompts = self._lane(0, lane_sms, LAYERS_AHEAD) if lanes else self._decoders
        self.decode = (
            GraphDecode(model, device, self.pad_slot, extra, buckets, upfront=self.pad_slot * lanes)
            if graphs and gpu
            else EagerDecode(model, device)
        )  # with lanes, every bucket of up to n_slots rows now: a capture waits for an idle lane
        self._eager = EagerDecode(model, device)  # a prompt's last token, in the prefill lane
        if lanes and gpu:  # the lanes' streams do not wait for the default one: what ran there
            torch.cuda.synchronize(device)
        self._capture = threading.Lock()
        self.sampler = DeviceSampler()
        self._slots: dict[int, _SlotSampling] = {}
        self.checkpoints: CheckpointStore[snap.DeviceCheckpoint] = CheckpointStore(
            partial(snap.save, model), partial(snap.load, model), snap.to_host
        )
        self.saves = SaveStream(device)

    def _lane(self, priority: int, sms: int = 0, layers_ahead: int = 0) -> Lane:
        gpu = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device, priority=priority) if gpu and self.lanes else None
        if stream is not None and sms:
            self._green, stream = green_stream(self.device, sms, self.model)
        rows = max(self.model.pools.n_slots, self._max_rows)  # verify steps: a row per draft
        host = HostBuffers.allocate(rows, MAX_N_PROBS)
        return Lane(stream, host, torch.cuda.Event() if gpu else None, layers_ahead=layers_ahead)

    slot_format = "device"  # how a saved slot's tensors are laid out (slot files check it)

    @property
    def checkpoint_nbytes(self) -> int:
        return self.model.pools.recurrent_nbytes

    def run(self, batch: ScheduledBatch) -> StepResult:
        lane = self._prompts if batch.lane else self._decoders
        rows = _decode_rows(batch)  # a row per token, drafts too (a graph of their own)
        g, n, runs = self.decode, sum(len(w.tokens) for w in rows), any(w.n_draft for w in rows)
        # the lane holds the lock through its batch; the decoders take it to capture a graph
        hold = batch.lane or (n > 0 and isinstance(g, GraphDecode) and not g.ready(n, runs))
        with self._capture if hold else contextlib.nullcontext():
            if lane.stream is None:
                return self._run(batch, lane)
            lane.stream.wait_stream(torch.cuda.default_stream(self.device))  # e.g. a bench's fill
            with torch.cuda.stream(lane.stream):
                t0 = time.perf_counter()
                result = self._run(batch, lane)
                if batch.lane:  # its seconds take in its wait for the GPU
                    lane.sync()
                    result.seconds = time.perf_counter() - t0
                return result

    def _run(self, batch: ScheduledBatch, lane: Lane) -> StepResult:
        t0 = time.perf_counter()
        for slot in batch.freed_slots:
            self._slots.pop(slot, None)
        written = [w.slot for w in batch.work] + [c.dst for c in batch.prefix_copies]
        written += [op.slot for op in batch.slot_ops]
        for slot in written:
            if slot >= self.pad_slot:
                raise ValueError(f"slot {slot} out of range (the model has {self.pad_slot})")
        self.saves.before(written)  # a slot still being saved is read to the end first
        for copy in batch.prefix_copies:  # before a new sequence resets a source's state
            snap.copy_prefix(self.model, self.checkpoints, copy)
        for w in batch.work:
            verify.check(self.model, w)
            if w.new_sequence:
                self._slots[w.slot] = _SlotSampling(seeded(w.sampling), list(w.history))
            if w.grammar is not None:
                self._slots[w.slot].matcher = Isolated(w.grammar.matcher, w.grammar.n_vocab)
            if w.start == 0:
                self.model.begin_sequence(w.slot)
        self.checkpoints.before(batch)
        if batch.slot_ops:  # a batch of its own, between steps
            saved: dict[str, SlotTensors] = {}
            for op in batch.slot_ops:
                if isinstance(op, SlotSave):
                    saved[op.id] = snap.save_slot(self.model, self.checkpoints, op, self.saves)
                elif isinstance(op, SlotLoad):
                    snap.load_slot(self.model, self.checkpoints, op, self.new_host_state)
            return StepResult(batch.step, seconds=time.perf_counter() - t0, saved=saved)
        decode = _decode_rows(batch)
        prefill = [w for w in batch.work if w not in decode]
        parts: list[tuple[list[SeqWork], torch.Tensor]] = []
        if prefill:
            parts.append(([w for w in prefill if w.sample], self._prefill(prefill, lane.window())))
        kept = verify.keep(self.model, decode)  # recurrent states a verify step may roll back
        step = self._eager if batch.lane else self.decode
        if decode:
            parts.append((decode, self._decode(decode, step)))
        self.checkpoints.after(batch)
        sampled = [w for ws, _ in parts for w in ws]
        for w in batch.work:  # the step's tokens enter the penalty windows (drafts: _sample)
            self._slots[w.slot].history.extend(w.tokens[: len(w.tokens) - w.n_draft])
        results: list[SeqResult] = []
        if sampled:
            logits = torch.cat([lg for _, lg in parts if lg.shape[0]])  # [S, V]
            results = self._sample(logits, sampled, lane)
        if kept:  # drafting sessions of a recurrent model
            verify.roll_back(self.model, kept, results, step.log, self.device)
        if not sampled and not batch.lane:  # a lane batch waits for all of its work (run)
            lane.pace()
        n_tokens = sum(len(w.tokens) for w in batch.work)
        failed = failures((w.request_id, self._slots[w.slot].matcher) for w in sampled)
        return StepResult(batch.step, results, n_tokens, time.perf_counter() - t0, failed=failed)

    def _prefill(self, work: list[SeqWork], window: LaunchWindow | None = None) -> torch.Tensor:
        d = self.device
        tokens = [t for w in work for t in w.tokens]
        pos = [w.start + i for w in work for i in range(len(w.tokens))]
        slots = [w.slot for w in work for _ in w.tokens]
        sizes = accumulate(len(w.tokens) for w in work)
        ends = [e - 1 for w, e in zip(work, sizes, strict=True) if w.sample]
        # through pinned memory: the host launches on while the GPU ends the step before
        extra = self.model.step_extra(
            [list(w.tokens) for w in work], [w.slot for w in work], packed=True
        )  # PLE rows as stored, decoded on the device
        step = Step(
            tokens=to_device(torch.tensor(tokens, dtype=torch.int64), d),
            pos=to_device(torch.tensor(pos, dtype=torch.int32), d),
            slots=to_device(torch.tensor(slots, dtype=torch.int32), d),
            decode=False,
            spans=tuple(Span(w.slot, w.start, len(w.tokens)) for w in work),
            logit_rows=to_device(torch.tensor(ends, dtype=torch.int64), d),
            extra=None if extra is None else to_device(extra, d),  # host rows (PLE)
            window=window,
        )
        end = getattr(self.model.backend.linear, "end_prompt", None)  # LinearCuda's
        with self.model.backend.path.step("prompt"):  # GEMMs at any size (ops/rowpath.py)
            try:
                return self.model.forward(step)
            finally:
                if end is not None:
                    end()

    def _decode(self, work: list[SeqWork], decode: GraphDecode | EagerDecode) -> torch.Tensor:
        """One row per token: a session's own, and its drafts' after it (module docstring)."""
        rows = [(t, w.start + i, w.slot) for w in work for i, t in enumerate(w.tokens)]
        tokens, pos, slots = (list(c) for c in zip(*rows, strict=True))
        extra = self.model.step_extra([[t] for t in tokens], slots)
        inp = DecodeInputs(tokens=tokens, pos=pos, slots=slots, extra=extra)
        with self.model.backend.path.step("decode"):  # decode kernels at any batch size
            return decode(inp)

    def _sample(self, logits: torch.Tensor, work: list[SeqWork], lane: Lane) -> list[SeqResult]:
        """Logits [rows, V] of ``work`` (1 + n_draft rows each) -> the sessions' tokens, drafts
        accepted while each row's token is the next draft (module docstring)."""
        states = [self._slots[w.slot] for w in work]
        v = self.model.spec.n_vocab
        rows: list[SamplingRow] = []
        for w, st in zip(work, states, strict=True):
            m: TokenMask | None = st.matcher if w.force is None else ForcedToken(w.force, v)
            rows.append(SamplingRow(st.params, st.history, st.counter, matcher=m))
            if w.n_draft:  # row i: as the i-th plain decode step would sample
                n = st.params.repeat_last_n
                tail = st.history if n < 0 else st.history[max(0, len(st.history) - n) :]
                for i in range(1, 1 + w.n_draft):
                    window = [*tail, *w.tokens[1 : i + 1]]
                    rows.append(SamplingRow(st.params, window, st.counter + i))
        out = self.sampler.sample(logits, kept_batch(lane.sampling, rows, v, self.device))
        host = out.to_host(lane.host)
        lane.sync()  # the step's one wait: ids are in pinned memory after it
        tokens = host.tokens.tolist()
        logprobs = host.logprob.tolist() if host.logprob is not None else None
        results = []
        r = 0  # the work's first row
        for w, st in zip(work, states, strict=True):
            k = 0  # drafts accepted
            while k < w.n_draft and tokens[r + k] == w.tokens[1 + k]:
                k += 1
            st.history.extend(w.tokens[1 : 1 + k])
            for i in range(r, r + k + 1):
                st.counter += 1
                if st.matcher is not None and w.force is None:
                    st.matcher.advance(tokens[i])
                top: tuple[TopLogprob, ...] = ()
                n = min(st.params.n_probs, MAX_N_PROBS)
                if n and host.top_ids is not None and host.top_logprobs is not None:
                    ids, lps = host.top_ids[i, :n].tolist(), host.top_logprobs[i, :n].tolist()
                    top = tuple(TopLogprob(a, b) for a, b in zip(ids, lps, strict=True))
                lp = logprobs[i] if logprobs is not None and st.params.want_logprob else None
                results.append(SeqResult(w.slot, w.request_id, tokens[i], lp, top))
            r += 1 + w.n_draft
        return results


def _decode_rows(batch: ScheduledBatch) -> list[SeqWork]:
    """The work that takes the decode step: one token past position 0 (+ drafts), sampled."""
    return [w for w in batch.work if len(w.tokens) == 1 + w.n_draft and w.start > 0 and w.sample]
