"""The pipeline model: from per-stage compute times and the links between consecutive stages,
predict prefill and decode throughput of a layer pipeline (for machines we cannot run).

The pipeline is a line of resources, each serving one micro-batch at a time, in order: the
host's link into the first GPU (token ids, positions, PLE rows), stage 0, the link to stage 1,
stage 1, ..., the last stage; a decode step then closes the ring back to the host (the sampled
token) and the first stage. A link carries per token the hand-off (costs.py: the residual and a
few ints, never anything of size O(context)) in ``latency + bytes / bandwidth``.

- Prefill: a prompt's chunks flow through the line, stage i working on chunk c while stage i-1
  works on chunk c+1 (``flow_shop``: the completion of every chunk on every resource, each chunk
  after its predecessor on the same resource and after its own previous resource). Once the
  pipe is full the throughput is chunk / (the busiest resource's time per chunk); the first
  chunk pays the whole line (fill) and the last ones drain it, which a short prompt feels.
- Decode: B sessions in m micro-batches (of ceil(B/m) sessions) circulate in the ring; a
  micro-batch's next token starts when its last one is sampled. One token of a micro-batch takes
  L = every stage and link once plus the loop back; a ring of one-at-a-time resources turns m
  micro-batches around in ``max(L, m * t_max)`` (t_max: the busiest resource per micro-batch):
  latency-bound with few micro-batches, bounded by the slowest stage with enough of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A copy path: ``latency`` seconds per transfer plus ``bandwidth`` bytes per second."""

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def flow_shop(jobs: Sequence[Sequence[float]]) -> list[float]:
    """When each job leaves the last resource: jobs pass resources in series, in job order, each
    resource serving one job at a time (``jobs[j][r]``: job j's time on resource r), with room
    for any number of jobs between resources."""
    done: list[float] = []
    prev: list[float] = [0.0] * (len(jobs[0]) if jobs else 0)
    for times in jobs:
        t, row = 0.0, []
        for r, dt in enumerate(times):
            t = max(t, prev[r]) + dt
            row.append(t)
        prev = row
        done.append(t)
    return done


def _line(stage_times: Sequence[float], links: Sequence[Link], tokens: int, handoff: int,
          host: Link | None, host_bytes: int) -> tuple[list[float], list[str]]:  # fmt: skip
    """(times, names) of the resources a micro-batch of ``tokens`` tokens passes, in order."""
    if len(links) != len(stage_times) - 1:
        raise ValueError(f"{len(stage_times)} stages need {len(stage_times) - 1} links")
    times, names = [], []
    if host is not None:
        times.append(host.time(tokens * host_bytes))
        names.append("host -> stage 0")
    for i, t in enumerate(stage_times):
        times.append(t)
        names.append(f"stage {i}")
        if i < len(links):
            times.append(links[i].time(tokens * handoff))
            names.append(f"link {i} -> {i + 1}")
    return times, names


@dataclass(frozen=True)
class PrefillResult:
    tokens: int
    chunk: int
    seconds: float  # the whole prompt, fill and drain included
    tokens_per_s: float
    steady_tokens_per_s: float  # once the pipe is full: chunk / the busiest resource's time
    fill_s: float  # the first chunk through the whole line
    bottleneck: str  # the busiest resource
    busy: tuple[float, ...]  # per resource: its share of the prompt's time spent working
    names: tuple[str, ...]


def prefill(chunk_times: Callable[[int, int], Sequence[float]], prompt: int, chunk: int,
            links: Sequence[Link], handoff: int, host: Link | None = None,
            host_bytes: int = 0) -> PrefillResult:  # fmt: skip
    """A ``prompt``-token prompt in chunks of ``chunk`` tokens; ``chunk_times(tokens, depth)``:
    each stage's seconds for a chunk of ``tokens`` tokens starting at ``depth``."""
    if prompt < 1 or chunk < 1:
        raise ValueError("prompt and chunk must be >= 1")
    jobs: list[list[float]] = []
    names: list[str] = []
    for start in range(0, prompt, chunk):
        n = min(chunk, prompt - start)
        times, names = _line(chunk_times(n, start), links, n, handoff, host, host_bytes)
        jobs.append(times)
    done = flow_shop(jobs)
    total = done[-1]
    work = [sum(j[r] for j in jobs) for r in range(len(names))]
    first = sum(jobs[0])
    worst = max(range(len(names)), key=lambda r: work[r])
    per_chunk = work[worst] / len(jobs)  # the busiest resource's mean time per chunk
    return PrefillResult(
        tokens=prompt,
        chunk=chunk,
        seconds=total,
        tokens_per_s=prompt / total,
        steady_tokens_per_s=prompt / len(jobs) / per_chunk,
        fill_s=first,
        bottleneck=names[worst],
        busy=tuple(w / total for w in work),
        names=tuple(names),
    )


@dataclass(frozen=True)
class DecodeResult:
    sessions: int
    micro_batches: int
    latency_s: float  # one token of a micro-batch around the whole ring
    cycle_s: float  # between two tokens of a session
    per_session_tps: float
    aggregate_tps: float
    bottleneck: str  # "latency" (the ring is not full) or the busiest resource


def decode(step_times: Callable[[int], Sequence[float]], sessions: int, micro_batches: int,
           links: Sequence[Link], handoff: int, host: Link | None = None, host_bytes: int = 0,
           loop_s: float = 0.0) -> DecodeResult:  # fmt: skip
    """``sessions`` decoding in ``micro_batches`` micro-batches; ``step_times(b)``: each stage's
    seconds for one step of a micro-batch of b sessions (at their depth); ``loop_s``: the sampled
    tokens' way back to the host and the scheduler's turn."""
    if not 1 <= micro_batches <= sessions:
        raise ValueError(f"micro-batches must be in 1..{sessions}, got {micro_batches}")
    b = -(-sessions // micro_batches)
    times, names = _line(step_times(b), links, b, handoff, host, host_bytes)
    latency = sum(times) + loop_s
    worst = max(range(len(times)), key=lambda r: times[r])
    cycle = max(latency, micro_batches * times[worst])
    bottleneck = "latency" if latency >= micro_batches * times[worst] else names[worst]
    return DecodeResult(
        sessions=sessions,
        micro_batches=micro_batches,
        latency_s=latency,
        cycle_s=cycle,
        per_session_tps=1.0 / cycle,
        aggregate_tps=sessions / cycle,
        bottleneck=bottleneck,
    )


@dataclass(frozen=True)
class Prediction:
    prefill: PrefillResult
    decode: tuple[DecodeResult, ...]  # per session count: the best grouping into micro-batches
    decode_each: tuple[DecodeResult, ...]  # per session count: each session its own micro-batch


def predict(chunk_times: Callable[[int, int], Sequence[float]],
            step_times: Callable[[int, int], Sequence[float]], links: Sequence[Link],
            handoff: int, *, prompt: int, chunk: int, depth: int, sessions: Sequence[int],
            host: Link | None = None, host_bytes: int = 0,
            loop_s: float = 0.0) -> Prediction:  # fmt: skip
    """Prefill of a ``prompt``-token prompt and decode at ``depth`` for each count of
    ``sessions``; ``step_times(b, depth)``: each stage's seconds for a step of b sessions."""
    pre = prefill(chunk_times, prompt, chunk, links, handoff, host, host_bytes)
    best, each = [], []
    for n in sessions:
        runs = [
            decode(lambda b: step_times(b, depth), n, m, links, handoff, host, host_bytes, loop_s)
            for m in range(1, n + 1)
        ]
        best.append(max(runs, key=lambda r: r.aggregate_tps))
        each.append(runs[-1])
    return Prediction(pre, tuple(best), tuple(each))


def measured_line(busy: Sequence[float], steps: int, parts: int = 1) -> list[float]:
    """Each stage's seconds per micro-batch from its busy seconds over ``steps`` steps of
    ``parts`` micro-batches each (the figures a run measures: timing.py, stage_stats.py)."""
    return [b / max(steps, 1) / parts for b in busy]


def check_run(prompt_busy: Sequence[float], prompt: int, chunk: int,
              step_busy: Sequence[float], steps: int, sessions: int,
              micro_batches: int) -> tuple[float, float]:  # fmt: skip
    """What the model predicts for a run from its stages' measured busy seconds, the links and
    the host taken as free: (prefill tokens/s of the ``prompt`` in chunks of ``chunk`` tokens,
    from each stage's busy seconds over the prompt, seconds per decode step of ``sessions`` in
    ``micro_batches``). The run's own figures against these show what its hand-offs and its host
    cost beyond the stages (bench pipeline-dist). A chunk's time on a stage is its tokens' share
    of the stage's busy seconds, so a shorter last chunk takes its share (a stage's chunks add up
    to what it measured).

    Decode as the runtime runs it: a step's micro-batches flow through the stages and the next
    step starts when the last is sampled (a flow shop of one step), not the ring of ``decode``,
    whose micro-batches go round independently (steps in flight, not built)."""
    per_token = measured_line(prompt_busy, prompt)
    free = [Link(float("inf"))] * (len(per_token) - 1)
    pre = prefill(lambda n, _: [t * n for t in per_token], prompt, chunk, free, 0)
    m = min(micro_batches, sessions)
    per_step = measured_line(step_busy, steps, m)
    return pre.tokens_per_s, flow_shop([per_step] * m)[-1]
