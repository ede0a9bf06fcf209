"""The engine's metrics, exposed through prometheus-client: llama-server's ``llamacpp:*`` names
where it has the metric, ``mgserve_*`` for the rest (README, Endpoints: ``/metrics``).

The engine actor reports what happens (``on_*``), on the event loop; numbers are plain ints and
floats. A scrape runs the collector on the same loop, so it sees one moment of one engine and
nothing locks; two scrapes at once read the same numbers and change none (llama-server resets its
throughput gauges on every scrape; here they are averages since start, so scrapers do not disturb
each other). Every engine has a registry of its own. Gauges that describe the scheduler (slots,
queue, cache depth, checkpoint bytes) are read from it at scrape time, never stale.

Step time is the runner's wall time per step. A step may carry prompt chunks and decode tokens
together (chunked prefill beside decoders): its seconds are shared between prompt and generation
in proportion to the tokens of each, and the step histogram labels it ``mixed``.

With a speculator, its ``SpecStats`` (mgserve/spec/stats.py, handed in as ``spec``) adds the
``mgserve_spec_*`` counters.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from mgserve.core.engine.contract import ScheduledBatch, StepResult

if TYPE_CHECKING:
    from mgserve.core.engine.scheduler import Scheduler
    from mgserve.spec.stats import SpecStats

# seconds; from 1 ms (a fast GPU decode step) to a minute (a long CPU prompt)
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")
PHASES = ("prefill", "decode", "mixed")  # what a step carried: prompt chunks, decode tokens, both


class Buckets:
    """One histogram's counts (prometheus-client renders them)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, x)] += 1
        self.sum += x

    def add_to(self, family: HistogramMetricFamily, labels: list[str] | None = None) -> None:
        cum, buckets = 0, []
        for le, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            cum += n
            buckets.append((le, cum))
        family.add_metric(labels or [], buckets, self.sum)


class EngineMetrics:
    """One engine's numbers and the collector that exposes them (``registry``)."""

    def __init__(
        self,
        sched: Scheduler,
        waiting: Callable[[], int],
        spec: SpecStats | None = None,
        runner: object = None,  # its model's own families, if any (runner_families)
    ) -> None:
        self._sched = sched
        self._extra = runner_families(runner)
        self._waiting = waiting  # requests queued beyond the free slots (Engine.waiting)
        self.spec = spec  # the speculator's counters (mgserve/spec/stats.py); None: no speculator
        self.prompt_tokens = 0  # computed, cache hits excluded
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.n_decode = 0  # runner steps
        self.n_busy_slots = 0  # summed over steps: sessions per step
        self.n_tokens_max = 0  # the deepest a slot's cache has been
        self.submitted = 0
        self.rejected = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.cache_hits = 0  # requests that reused part of a slot's cache
        self.tokens_reused = 0
        self.restores = 0
        self.prefix_copies = 0  # prompt prefixes copied from another slot (placement.py)
        self.ttft, self.itl = Buckets(), Buckets()
        self.steps = {p: Buckets() for p in PHASES}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- what happens ----------------------------------------------------------------------------

    def on_started(self, n_reused: int) -> None:
        """A request's first work was planned, past ``n_reused`` tokens of its slot's cache."""
        self.cache_hits += n_reused > 0
        self.tokens_reused += n_reused

    def on_step(self, batch: ScheduledBatch, n_prompt: int, result: StepResult) -> None:
        """A step ran: ``n_prompt`` of its tokens were prompt chunks, the rest decode tokens."""
        n_decode = sum(len(w.tokens) for w in batch.work) - n_prompt
        share = n_prompt / (n_prompt + n_decode)
        self.prompt_tokens += n_prompt
        self.prompt_seconds += result.seconds * share
        self.predicted_tokens += len(result.results)
        self.predicted_seconds += result.seconds * (1.0 - share)
        self.n_decode += 1
        self.n_busy_slots += len(batch.work)
        self.n_tokens_max = max([self.n_tokens_max, *(w.start + len(w.tokens) for w in batch.work)])
        self.restores += sum(w.restore for w in batch.work)
        phase = "mixed" if n_prompt and n_decode else "prefill" if n_prompt else "decode"
        self.steps[phase].observe(result.seconds)

    def on_token(self, first: bool, seconds: float) -> None:
        """A token reached its request, ``seconds`` after its submit (first) or its last token."""
        (self.ttft if first else self.itl).observe(seconds)

    def on_finish(self, finish_reason: str) -> None:
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    # -- the collector ---------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        sched = self._sched
        n_slots = len(sched.slots)
        depth = sum(len(s.cached) for s in sched.slots)

        def rate(n: float, s: float) -> float:
            return n / s if s > 0 else 0.0

        yield from (
            CounterMetricFamily(name, help, value=v)
            for name, help, v in (
                (
                    "llamacpp:prompt_tokens_total",
                    "Number of prompt tokens processed.",
                    self.prompt_tokens,
                ),
                ("llamacpp:prompt_seconds_total", "Prompt process time", self.prompt_seconds),
                (
                    "llamacpp:tokens_predicted_total",
                    "Number of generation tokens processed.",
                    self.predicted_tokens,
                ),
                (
                    "llamacpp:tokens_predicted_seconds_total",
                    "Predict process time",
                    self.predicted_seconds,
                ),
                ("llamacpp:n_decode_total", "Total number of model steps", self.n_decode),
                (
                    "mgserve_requests_submitted_total",
                    "requests accepted (queued or placed)",
                    self.submitted,
                ),
                (
                    "mgserve_requests_rejected_total",
                    "requests refused: the queue was full (503)",
                    self.rejected,
                ),
                (
                    "mgserve_prompt_cache_hits_total",
                    "requests that reused part of a slot's cache (theirs or a copy)",
                    self.cache_hits,
                ),
                (
                    "mgserve_prompt_tokens_reused_total",
                    "prompt tokens reused from a slot's cache",
                    self.tokens_reused,
                ),
                (
                    "mgserve_checkpoint_restores_total",
                    "recurrent-state checkpoints restored",
                    self.restores,
                ),
                (
                    "mgserve_prefix_copies_total",
                    "prompt prefixes copied from another slot's cache",
                    self.prefix_copies,
                ),
            )
        )
        book = sched.checkpoints
        yield from (
            GaugeMetricFamily(name, help, value=v)
            for name, help, v in (
                (
                    "llamacpp:prompt_tokens_seconds",
                    "Average prompt throughput in tokens/s.",
                    rate(self.prompt_tokens, self.prompt_seconds),
                ),
                (
                    "llamacpp:predicted_tokens_seconds",
                    "Average generation throughput in tokens/s.",
                    rate(self.predicted_tokens, self.predicted_seconds),
                ),
                (
                    "llamacpp:n_busy_slots_per_decode",
                    "Average number of busy slots per model step",
                    rate(self.n_busy_slots, self.n_decode),
                ),
                ("llamacpp:n_tokens_max", "Largest observed n_tokens.", self.n_tokens_max),
                ("llamacpp:requests_processing", "Number of requests processing.", sched.n_busy),
                ("llamacpp:requests_deferred", "Number of requests deferred.", self._waiting()),
                ("llamacpp:kv_cache_tokens", "KV-cache tokens.", depth),
                (
                    "llamacpp:kv_cache_usage_ratio",
                    "KV-cache usage. 1 means 100 percent usage.",
                    depth / (n_slots * sched.n_ctx),
                ),
                ("mgserve_slots_total", "slots (--parallel)", n_slots),
                (
                    "mgserve_checkpoint_device_bytes",
                    "recurrent-state checkpoints in device memory",
                    book.nbytes_in(host=False),
                ),
                (
                    "mgserve_checkpoint_host_bytes",
                    "recurrent-state checkpoints in host memory",
                    book.nbytes_in(host=True),
                ),
            )
        )
        done = CounterMetricFamily(
            "mgserve_requests_total", "finished requests", labels=["finish_reason"]
        )
        for reason, n in self.finished.items():
            done.add_metric([reason], n)
        yield done
        for name, help, buckets in (
            ("mgserve_time_to_first_token_seconds", "submit to first token", self.ttft),
            ("mgserve_inter_token_latency_seconds", "between consecutive tokens", self.itl),
        ):
            family = HistogramMetricFamily(name, help)
            buckets.add_to(family)
            yield family
        steps = HistogramMetricFamily(
            "mgserve_step_seconds",
            "one model step on the runner, by what it carried",
            labels=["phase"],
        )
        for phase, b in self.steps.items():
            b.add_to(steps, [phase])
        yield steps
        if self.spec is not None:
            yield from _spec_families(self.spec)
        if self._extra is not None:
            yield from self._extra()


def _spec_families(spec: SpecStats) -> Iterator[Metric]:
    """n-gram speculation's counters (mgserve/spec/stats.py says what each counts)."""
    yield from (
        CounterMetricFamily(f"mgserve_spec_{name}", help, value=v)
        for name, help, v in (
            ("draft_proposed", "draft tokens verified", spec.proposed),
            ("draft_accepted", "draft tokens that held", spec.accepted),
            ("steps", "model steps that carried drafts", spec.steps),
            ("verifies", "session steps that carried drafts", spec.verifies),
            ("tokens_emitted", "tokens emitted by session steps with drafts", spec.emitted),
        )
    )
    for name, help, counts in (
        ("proposed", "drafts proposed at position i (from 0)", spec.proposed_by_position),
        ("accepted", "drafts i (from 0) that held, all before it too", spec.accepted_by_position),
    ):
        family = CounterMetricFamily(f"mgserve_spec_{name}_by_position", help, labels=["position"])
        for i, n in enumerate(counts):
            family.add_metric([str(i)], n)
        yield family
    yield GaugeMetricFamily(
        "mgserve_spec_tokens_per_step",
        "mean tokens a session step with drafts emitted (1 + the drafts that held)",
        value=spec.tokens_per_step,
    )


def runner_families(runner: object) -> Callable[[], Iterator[Metric]] | None:
    """The metric families of a runner's model where it has some (a staged model's per-stage
    figures: mgserve/pipeline/timing.py), else None."""
    return getattr(getattr(runner, "model", None), "metric_families", None)
