"""Decode steps as CUDA graphs, one per batch-size bucket (DESIGN.md: no per-layer Python
launches in decode).

A decode step reads only device tensors of shape [B] (tokens, positions, slots; see
``models/base.Step``), so one capture per B serves every later step of B sessions: the runner
writes the step's inputs into one pinned int64 block, copies it to the device in one transfer
and replays the graph, whose first nodes spread the block over its typed static buffers (one
host launch where there were seven copies, each with its dtype conversion). B is rounded up to a
bucket; the padding rows decode a dummy token in the pools' spare slot (index ``n_slots``, never
given to a session), whose state nobody reads. Every B up to 8 is its own bucket: a padding row
costs a real token's work (its ten experts' weights above all: five sessions padded to eight read
60% more expert bytes), while a graph costs only its capture, once, at the first step of its B.

A speculation verify step gives a drafting session a run of rows (consecutive rows of one slot,
``ops/chains.py``): the runs travel as three more [B] inputs. A recurrent model's verify step
logs how to re-run its state updates (``Step.log``, the runner's rollback: cuda/verify.py): such
steps replay a graph of their own per bucket (captured at the bucket's first verify step), which
logged at its capture and keeps the logged tensors (the recurrent layers' inputs, e.g.
[B, conv_dim + 2 H_v] per DeltaNet layer) alive in the pool, rewritten by each replay; plain
steps keep graphs that log nothing (no memory held past the step) and whose recurrent ops take
every row alone, as before runs existed.

On a device without graphs (the CPU, or ``graphs=False`` for debugging) ``EagerDecode`` runs the
same forward directly, so tests of the step logic run anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mgserve.cuda.models.base import DeviceLM, Replay, Step
from mgserve.cuda.ops.chains import Chains, has_runs, runs_of, to_device

BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
# op-family switches that change what a decode step launches (hc.cluster also its bits, as a
# tuning does): a graph is captured per setting (bench model --paired R --toggle one of them
# times both from graphs; route.split's group size and route.unroll are keyed too)
GRAPH_SWITCHES = (
    "branch.decode", "moe.shared_parts", "hc.cluster", "route.lean", "qsa.cluster",
    "hc.stage_hoist", "route.tickets.acq_rel", "route.split", "route.split_tokens",
    "route.unroll", "route.batch",
)  # fmt: skip
_SWITCH_PATHS = tuple(tuple(name.split(".")) for name in GRAPH_SWITCHES)  # family, .., attribute
POW2_BUCKETS = (1, 2, 4, 8, 16)  # the buckets before 2026-12-03 (bench comparisons)
# speculation's verify steps: 1 + k rows per drafting session (cuda/runner.py), k up to 48
DRAFT_BUCKETS = (20, 24, 28, 32, 40, 48, 56, 64, 80, 98)


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} decoding sessions exceed the largest graph bucket {buckets[-1]}")


@dataclass
class DecodeInputs:
    """One decode step's inputs on the host: B sessions, one token each."""

    tokens: list[int]
    pos: list[int]
    slots: list[int]
    extra: torch.Tensor | None = None  # [B, ...] model-specific rows (PLE), host float32


class _Captured:
    def __init__(self, model: DeviceLM, b: int, pad_slot: int, extra_shape: tuple[int, ...] | None,
                 device: torch.device, pool: Any, logged: bool = False) -> None:  # fmt: skip
        self.b = b
        self.tokens = torch.zeros(b, dtype=torch.int64, device=device)
        self.pos = torch.ones(b, dtype=torch.int32, device=device)  # position 1: never a start
        self.slots = torch.full((b,), pad_slot, dtype=torch.int32, device=device)
        self.lengths = torch.full((b,), 2, dtype=torch.int32, device=device)  # pos + 1
        self.extra = (
            torch.zeros((b, *extra_shape), dtype=torch.float32, device=device)
            if extra_shape is not None
            else None
        )
        self.chains = Chains.buffers(b, device, runs=logged)
        # the step's [B] inputs travel as one int64 block (pinned on the host, one copy a step);
        # the graph's first nodes spread it over the typed buffers above
        self.staging = torch.stack([t.to(torch.int64) for t in self._inputs()])  # [7, b]
        self.host = torch.empty_like(self.staging, device="cpu").pin_memory()
        self.host_extra = (
            torch.empty((b, *extra_shape), dtype=torch.float32).pin_memory()
            if extra_shape is not None
            else None
        )
        self.copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffers
        step = Step(
            self.tokens, self.pos, self.slots, decode=True, extra=self.extra, lengths=self.lengths,
            chains=self.chains,
        )  # fmt: skip
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # a capture always runs the decode kernels, at any bucket size (ops/rowpath.py), whoever
        # asks for it: a step inside path.step("decode") or the runner's up-front captures
        path = model.backend.path
        with torch.cuda.stream(stream), path.step("decode"):  # warm up: kernels compiled,
            self._spread()
            model.forward(step)  # workspaces allocated
        torch.cuda.current_stream(device).wait_stream(stream)
        self.log: list[Replay] = []
        step.log = self.log if logged else None  # the capture's log: its tensors, every replay's
        ready = getattr(model, "before_capture", None)  # a pipeline across processes: no send
        if ready is not None:  # in flight during the capture
            ready()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), path.step("decode"):
            self._spread()
            self.logits = model.forward(step)  # [b, V], rewritten by every replay
        self.model = model
        take = getattr(model, "take_graph_io", None)  # a pipeline across processes' hand-offs
        self.io = take() if take is not None else None

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        """The typed [B] inputs, in the staged block's row order (``run`` fills the rows)."""
        c = self.chains
        return self.tokens, self.pos, self.slots, self.lengths, c.runs, c.depth, c.last

    def _spread(self) -> None:
        """The staged int64 block into the typed [B] inputs (graph nodes once captured)."""
        for row, t in zip(self.staging, self._inputs(), strict=True):
            t.copy_(row)

    def run(self, inp: DecodeInputs, pad_slot: int) -> torch.Tensor:
        # before any input moves: copy_ would convert rows of another dtype (packed PLE bytes)
        if self.extra is not None and inp.extra is not None and inp.extra.dtype != self.extra.dtype:
            raise TypeError(f"{inp.extra.dtype} rows: the graph's are {self.extra.dtype}")
        n = len(inp.tokens)
        runs, depth, last = runs_of(inp.slots)  # padding rows: each alone
        if self.copied is not None:  # the pinned buffers' last copy has left them
            self.copied.synchronize()
        else:
            self.copied = torch.cuda.Event()
        h = self.host.numpy()
        for i, (row, fill) in enumerate(
            ((inp.tokens, 0), (inp.pos, 1), (inp.slots, pad_slot), ([p + 1 for p in inp.pos], 2),
             (runs, 1), (depth, 0))
        ):  # fmt: skip
            h[i, :n], h[i, n:] = row, fill
        h[6, :n], h[6, n:] = last, range(n, self.b)
        self.staging.copy_(self.host, non_blocking=True)
        if self.extra is not None and inp.extra is not None and self.host_extra is not None:
            self.host_extra[:n].copy_(inp.extra)
            self.extra[:n].copy_(self.host_extra[:n], non_blocking=True)
        self.copied.record(torch.cuda.current_stream(self.staging.device))  # the copies' stream
        if self.io is not None:
            self.model.before_replay(self.io)  # type: ignore[attr-defined]
        self.graph.replay()
        if self.io is not None:
            self.model.after_replay(self.io)  # type: ignore[attr-defined]
        return self.logits[:n]


class GraphDecode:
    """Captures lazily: the first step of B sessions pays for the capture of B's bucket."""

    def __init__(self, model: DeviceLM, device: torch.device, pad_slot: int,
                 extra_shape: tuple[int, ...] | None = None,
                 buckets: tuple[int, ...] = BUCKETS, upfront: int = 0) -> None:  # fmt: skip
        """``upfront``: capture the buckets of 1..upfront rows now, not at their first step."""
        self.model, self.device, self.pad_slot = model, device, pad_slot
        self.extra_shape, self.buckets = extra_shape, buckets
        # (bucket, logged, GRAPH_SWITCHES' settings) -> graph
        self._graphs: dict[tuple[int, bool, tuple[object, ...]], _Captured] = {}
        self.log: list[Replay] = []  # the last step's (its graph's)
        self._pool = torch.cuda.graph_pool_handle()  # buckets share one memory pool
        for b in sorted({bucket_for(n, buckets) for n in range(1, upfront + 1)}):
            key = (b, False, self._switches())
            self._graphs[key] = _Captured(model, b, pad_slot, extra_shape, device, self._pool)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _, _ in self._graphs}))

    def _switches(self) -> tuple[object, ...]:
        """The backend's GRAPH_SWITCHES now (None where a family has no such switch)."""
        out = []
        for path in _SWITCH_PATHS:
            obj: object = self.model.backend
            for name in path:
                obj = getattr(obj, name, None)
            out.append(obj)
        return tuple(out)

    def _key(self, n: int, runs: bool) -> tuple[int, bool, tuple[object, ...]]:
        """The graph of ``n`` rows, ``runs``: some rows form runs (a recurrent model logs)."""
        return bucket_for(n, self.buckets), runs and not self.model.rewindable, self._switches()

    def ready(self, n: int, runs: bool = False) -> bool:
        """Whether a step of ``n`` rows (``runs``: with drafts) replays a graph captured."""
        return self._key(n, runs) in self._graphs

    def __call__(self, inp: DecodeInputs) -> torch.Tensor:
        key = self._key(len(inp.tokens), has_runs(inp.slots))
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _Captured(
                self.model, key[0], self.pad_slot, self.extra_shape, self.device, self._pool,
                logged=key[1],
            )  # fmt: skip
        self.log = g.log
        logits = g.run(inp, self.pad_slot)
        replayed = getattr(self.model, "replayed", None)  # a pipeline's per-step figures
        if replayed is not None:
            replayed(key[0])
        return logits

    def replay_ms(self, n: int, reps: int = 16) -> float | None:
        """GPU time of a step of ``n`` rows alone: its graph (None if not captured yet) replayed
        ``reps`` times back to back between two events, on the inputs the last step left (the
        rows' state advances: for benchmarks only). Against a served step's time, what is left
        is everything outside the model's graph: sampling, the copies of ids and inputs, the
        host's work between steps."""
        g = self._graphs.get(self._key(n, False))
        if g is None or g.io is not None or reps < 1:  # io: a pipeline rank's hand-offs
            return None
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.graph.replay()  # the first replay after a served step may pay for its setup
        start.record()
        for _ in range(reps):
            g.graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / reps


class EagerDecode:
    """The same step without graphs (it logs only a step with runs)."""

    def __init__(self, model: DeviceLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.log: list[Replay] = []  # the last step's

    def __call__(self, inp: DecodeInputs) -> torch.Tensor:
        d = self.device
        chains = Chains.of(inp.slots, d)
        self.log = []
        step = Step(  # inputs queued through pinned memory: no wait for the GPU (to_device)
            to_device(torch.tensor(inp.tokens, dtype=torch.int64), d),
            to_device(torch.tensor(inp.pos, dtype=torch.int32), d),
            to_device(torch.tensor(inp.slots, dtype=torch.int32), d),
            decode=True,
            extra=None if inp.extra is None else to_device(inp.extra, d),
            lengths=to_device(torch.tensor([p + 1 for p in inp.pos], dtype=torch.int32), d),
            chains=chains,
            log=None if chains.alone else self.log,
        )
        return self.model.forward(step)
