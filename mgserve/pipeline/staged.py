"""A device model run as the stages of a layer pipeline: ``StagedLM`` is the model with its
forward split at the stages' layer ranges, the hand-offs going through a ``Transport``
(transport.py); everything else (pools, host state, PLE rows, checkpoints) is the model's own, so
a ``DeviceRunner`` runs it as it runs the model.

One step goes through the stages in order: the first embeds (``stage_in``: the token embedding,
or qwen4exp's hyper-connection streams; the step's host-made inputs such as qwen4exp's PLE rows
ride on the ``Step``, which every stage reads), each runs its layers (``stage_layers``), hands off
the residual stream, and the last applies the head (``stage_out``). The arithmetic is the
one-stage forward's, op for op, so the tokens are bitwise the same for any split
(tests/cuda/test_device_stages.py, test_device_stages_dist.py).

``--virtual-stages N`` (``virtual_stages``) runs N stages on one device with ``LocalTransport``;
the layers are split by the stage plan's balance (decode weight bytes per layer and the head's on
the last stage: ``stages.best_split``). A decode step is captured into a CUDA graph as one
stage is: the capture takes in every stage's stream and the host staging copies between them
(transport.py).

Per-stage figures (busy seconds and fraction, bubbles, bytes and seconds per link) are recorded
by ``timing.py`` and shown in /metrics. A graph's replay counts as a step and its links' bytes
(``replayed``), but in one process its stage times are measured only in steps run without a
graph (prompt chunks, and every step with ``graphs=False``); across processes a replay is the
rank's stage, timed around it (``before_replay``, ``after_replay``).

With ``micro_batches`` > 1 a plain decode step's sessions go through the stages in groups
(micro.py), stage i computing group j + 1 while stage i + 1 computes group j: the stages overlap.
In one process a prompt chunk's stages still run one after another (the next step's chunk waits
for this one's last stage); across processes (``DistTransport``, lockstep.py: each process loads
only its stage) the first stage goes on to the next chunk while the last computes this one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from prometheus_client.metrics_core import Metric

from mgserve.config import Settings
from mgserve.core.gguf.reader import GGUFFile
from mgserve.cuda.models.base import Staged, Step
from mgserve.pipeline.micro import groups, splittable, sub_step
from mgserve.pipeline.stages import StagePlan
from mgserve.pipeline.timing import StageTiming, families
from mgserve.pipeline.transport import HANDOFF_DTYPE, LocalTransport, Transport

log = logging.getLogger(__name__)


def check_ranges(ranges: Sequence[tuple[int, int]], n_layer: int) -> list[tuple[int, int]]:
    """``ranges`` if they cover layers 0..n_layer - 1 contiguously, a layer or more each."""
    out, at = [(int(a), int(b)) for a, b in ranges], 0
    for a, b in out:
        if a != at or b <= a:
            raise ValueError(f"stage ranges {out} do not split {n_layer} layers contiguously")
        at = b
    if at != n_layer:
        raise ValueError(f"stage ranges {out} do not cover the {n_layer} layers")
    return out


class StagedLM:
    """The model's forward over ``ranges`` (one per stage, or a ``StagePlan``'s) through
    ``transport``; every other attribute is the model's. In a process that does not run the last
    stage, ``forward`` returns the logits the transport brings (``DistTransport``: broadcast from
    the last stage)."""

    def __init__(
        self,
        model: Any,
        ranges: Sequence[tuple[int, int]] | StagePlan,
        transport: Transport,
        micro_batches: int = 1,
    ) -> None:
        if not isinstance(model, Staged):
            raise ValueError(f"{type(model).__name__} does not run as pipeline stages")
        self.model = model
        if isinstance(ranges, StagePlan):
            ranges = ranges.ranges
        self.ranges = check_ranges(ranges, model.spec.n_layer)
        if transport.n_stages != len(self.ranges):
            raise ValueError(f"a transport of {transport.n_stages} stages for {len(ranges)}")
        self.transport = transport
        if micro_batches < 1:
            raise ValueError(f"micro-batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches  # decode steps' session groups in flight (micro.py)
        links = len(self.ranges) - 1
        apart = not isinstance(transport, LocalTransport)  # stages in other processes
        on_gpu = getattr(getattr(model, "device", None), "type", "cpu") == "cuda"
        gpu = getattr(transport, "gpu", apart and on_gpu)
        carried = getattr(transport, "link_bytes", None) or getattr(transport, "sent_bytes", None)
        self.timing = StageTiming(
            len(self.ranges), bool(gpu), lambda: list(carried or [0] * links), step_span=apart
        )
        self.peers: Any = None  # rank 0's view of the other ranks' figures (stage_stats.py)
        self._replaying: int | None = None  # the stage a replay across processes is timed as
        self._counted = False  # ``before_replay`` counted the step being replayed

    def metric_families(self) -> Iterator[Metric]:
        """Per-stage figures for /metrics (timing.py): every stage's where all run in this
        process; across processes, rank 0's with the other ranks' (``peers``), else none."""
        if isinstance(self.transport, LocalTransport):
            return self.timing.families()
        if self.peers is None:
            return iter(())
        return families(self.peers.figures(self.timing.figures()))

    def __getattr__(self, name: str) -> Any:  # the model's pools, spec, backend, ...
        return getattr(self.__dict__["model"], name)

    def forward(self, step: Step) -> torch.Tensor:
        m, t = self.model, self.transport
        n, last = step.tokens.shape[0], len(self.ranges) - 1
        dev = step.tokens.device
        parts = [(0, n)]
        if self.micro_batches > 1 and splittable(step):
            parts = groups(n, self.micro_batches)
        steps = [step] if len(parts) == 1 else [sub_step(step, a, b) for a, b in parts]
        t.begin()  # after the sub-steps' inputs: the stages wait for them
        timing = self.timing
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            timing = StageTiming(len(self.ranges), False, list)  # no events inside a graph
        timing.begin()
        outs: list[torch.Tensor] = []
        for j, sub in enumerate(steps):  # group j + 1 enters stage 0 as group j moves on
            rows = sub.tokens.shape[0]
            for i, (a, b) in enumerate(self.ranges):
                if not t.runs(i):
                    continue
                with t.on(i):
                    received = None
                    if i:
                        timing.receiving(i)
                        received = t.recv(i, (rows, *m.handoff_shape), dev)
                        timing.arrived(i - 1)
                    with timing.stage(i, final=j == len(steps) - 1):
                        x = m.stage_in(sub) if received is None else received
                        x = m.stage_layers(x, sub, a, b)
                        if i == last:
                            outs.append(m.stage_out(x, sub))
                            if len(outs) == len(steps) > 1:
                                outs = [torch.cat(outs)]
                    if i < last:
                        timing.sent(i)
                        t.send(i, x)
        logits = outs[0] if outs else None
        r = n if step.logit_rows is None else step.logit_rows.shape[0]
        # every rank's runner samples a verify step of a recurrent model: it rolls back by its draws
        rewinds = getattr(m, "rewindable", True)
        drafts = step.chains is not None and not step.chains.alone and not rewinds
        logits = t.logits(logits, (r, m.spec.n_vocab), dev, everyone=drafts)
        timing.end()
        return logits

    def take_graph_io(self) -> Any:
        """The hand-offs a decode graph just captured must make at each replay, where its
        transport cannot run inside a capture (transport_dist.py); None: none (graphs.py)."""
        take = getattr(self.transport, "take_graph_io", None)
        return take() if take is not None else None

    def before_capture(self) -> None:
        """Before a decode graph's capture: nothing of the transport's in flight."""
        ready = getattr(self.transport, "before_capture", None)
        if ready is not None:
            ready()

    def before_replay(self, io: Any) -> None:
        """Across processes (graphs.py, transport_dist.py): the replay's input received, timed
        as the stage's wait; the replay itself is the stage's work (one stage per process)."""
        tm, mine = self.timing, [i for i in range(len(self.ranges)) if self.transport.runs(i)]
        tm.begin()
        self._counted = True  # this replay's step (``replayed``)
        waits = io.received[0][0] if io.received else None
        if waits is not None:
            tm.receiving(waits)
        self.transport.before_replay(io)  # type: ignore[attr-defined]
        if waits is not None:
            tm.arrived(waits - 1)
        self._replaying = mine[0] if len(mine) == 1 else None
        if self._replaying is not None:
            tm.start(self._replaying)

    def after_replay(self, io: Any) -> None:
        if self._replaying is not None:
            self.timing.stop(self._replaying)
            self._replaying = None
        self.transport.after_replay(io)  # type: ignore[attr-defined]
        self.timing.end()

    def replayed(self, rows: int) -> None:
        """A captured decode step of ``rows`` rows ran again (graphs.py): a step whose links each
        carried the rows' hand-offs. In one process its stage times are not measured (no events
        in a graph); across processes ``before_replay`` counted and timed it."""
        if not self._counted:
            self.timing.steps += 1
        self._counted = False
        carried = getattr(self.transport, "link_bytes", None)
        if carried is not None:
            per_row = HANDOFF_DTYPE.itemsize * math.prod(self.model.handoff_shape)
            for i in range(len(carried)):
                carried[i] += rows * per_row


def balanced_ranges(g: GGUFFile, n_stages: int, type_k: str = "f16",
                    type_v: str = "f16") -> list[tuple[int, int]]:  # fmt: skip
    """``n_stages`` contiguous layer ranges of ``g``'s model whose busiest stage reads the fewest
    weight bytes per decode token (the stage plan's default balance), memory not considered."""
    from mgserve.pipeline.costs import ModelCosts
    from mgserve.pipeline.stages import Balance, best_split

    costs = ModelCosts.of(g, type_k, type_v)
    n = costs.sizes.spec.n_layer
    if not 1 <= n_stages <= n:
        raise ValueError(f"a pipeline of {n_stages} stages for {n} layers: 1 to {n} stages")
    found = best_split(n, n_stages, Balance.decode_bytes(costs).cost, lambda *_: True)
    assert found is not None  # nothing refuses a split
    return found


def process_ranges(g: GGUFFile, settings: Settings, world: int,
                   n_layer: int) -> list[tuple[int, int]]:  # fmt: skip
    """The layer ranges of a pipeline across ``world`` processes (lockstep.py), one per rank:
    ``--tensor-split``'s shares, or balanced by decode weight bytes (``balanced_ranges``)."""
    from mgserve.devices import parse_split
    from mgserve.pipeline.stages import split_shares

    if settings.tensor_split is None:
        return balanced_ranges(g, world, settings.cache_type_k, settings.cache_type_v)
    shares = parse_split(settings.tensor_split)
    if len(shares) != world:  # settings_checks refuses it first where the world is known
        raise ValueError(f"--tensor-split {settings.tensor_split}: {len(shares)} shares for a "
                         f"pipeline of {world} processes (one share per rank)")  # fmt: skip
    return split_shares(n_layer, shares)


def virtual_stages(model: Any, ranges: Sequence[tuple[int, int]], device: torch.device,
                   micro_batches: int = 1,
                   link_gbps: Sequence[float] | None = None) -> StagedLM:  # fmt: skip
    """``model`` as len(ranges) stages on its one ``device`` (``--virtual-stages``), decode steps
    in ``micro_batches`` groups of sessions, the links throttled to ``link_gbps`` if given."""
    transport = LocalTransport(len(ranges), device, link_gbps)
    staged = StagedLM(model, ranges, transport, micro_batches)
    log.info(
        "%d virtual stages on %s: layers %s; decode in %d micro-batches",
        len(ranges), device, ", ".join(f"{a}-{b - 1}" for a, b in staged.ranges), micro_batches,
    )  # fmt: skip
    return staged
