"""The timed workloads of ``mgserve bench model``: prefill (one prompt, interleaved prompts, an
estimate for prompts too long to run) and decode of B sessions at a depth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from mgserve.bench.model.harness import ModelBench


def time_prefill(b: ModelBench, n: int, depth: int, repeat: int = 1) -> tuple[float, str]:
    """(tokens/s, note) of one prompt of ``n`` tokens at ``depth``: the median of ``repeat``
    runs (the note gives their range when there are several)."""
    if repeat < 1:
        raise ValueError(f"--prefill-repeat must be at least 1, got {repeat}")
    rates = []
    for _ in range(repeat):
        b.fill(0, depth)
        b.sync()
        t0 = time.perf_counter()
        b.prefill(0, depth, n)
        b.sync()
        rates.append(n / (time.perf_counter() - t0))
    note = f"median of {repeat}: {min(rates):.1f} to {max(rates):.1f}" if repeat > 1 else ""
    return statistics.median(rates), note


def time_multi_prefill(b: ModelBench, sessions: int, n: int) -> float:
    """``sessions`` prompts of ``n`` tokens, one chunk of each per step (as the scheduler
    interleaves them)."""
    ub = b.args.ubatch
    prompts = [b.tokens(n, 11 + s) for s in range(sessions)]
    b.torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in range(0, n, ub):
        b.run_step([b.work(s, p[c : c + ub], c, c + ub >= n) for s, p in enumerate(prompts)])
    b.torch.cuda.synchronize()
    return sessions * n / (time.perf_counter() - t0)


def time_sampled_prefill(
    b: ModelBench, sessions: int, n: int, samples: int = 5
) -> tuple[float, str]:
    """Aggregate tokens/s of ``sessions`` prompts of ``n`` tokens, estimated: at the midpoints
    of ``samples`` equal parts of the prompt, each session is filled to that depth and one step
    with an ubatch chunk of every session is timed; the estimate is the mean step time."""
    ub = b.args.ubatch
    depths = [int((i + 0.5) * n / samples) // ub * ub for i in range(samples)]
    times = []
    for d in depths:
        for s in range(sessions):
            b.fill(s, d)
        work = [b.work(s, b.tokens(ub, 31 + s), d, True) for s in range(sessions)]
        b.torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.run_step(work)
        b.torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    note = "sampled at depths " + "/".join(f"{d // 1024}k" for d in depths)
    return sessions * ub / statistics.mean(times), note


def decoding(b: ModelBench, sessions: int, depth: int) -> Callable[[], None]:
    """Slots 0..sessions-1 brought to ``depth``, and what runs their next decode step (one
    token each, as the runner serves it), each call one position further on."""
    for s in range(sessions):
        b.fill(s, depth)
    if depth == 0:  # a one-token prompt first, so decode starts at position 1
        b.run_step([b.work(s, b.tokens(1, s), 0, True) for s in range(sessions)])
    i, pos = 0, max(depth, 1)

    def step() -> None:
        nonlocal i, pos
        b.run_step([b.work(s, ((1000 + i) % b.vocab,), pos, True) for s in range(sessions)])
        i, pos = i + 1, pos + 1

    return step


def time_decode(b: ModelBench, sessions: int, depth: int) -> tuple[float, float]:
    """(aggregate tokens/s, median step ms) of ``sessions`` sessions decoding at ``depth``."""
    step = decoding(b, sessions, depth)
    times = []
    for i in range(b.args.decode_steps + 3):
        t0 = time.perf_counter()
        step()
        if i >= 3:  # warm-up steps capture the graph
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times)
    return sessions / ms, ms * 1e3


def gpu_alone_ms(b: ModelBench, sessions: int) -> float | None:
    """The GPU time of the last decode workload's model graph alone, replayed back to back
    (GraphDecode.replay_ms); against the served step, what is left is everything outside that
    graph: sampling, the copies of ids and inputs, the host's work between steps. None where
    there is no graph (eager, the CPU)."""
    replay_ms = getattr(getattr(b.runner, "decode", None), "replay_ms", None)
    return replay_ms(sessions) if replay_ms is not None else None


def alone_note(gpu_ms: float | None, ms: float) -> str:
    """``; graph alone X ms (outside it +Y)`` for a served step of ``ms``, or ""."""
    if gpu_ms is None:
        return ""
    return f"; graph alone {gpu_ms:.2f} ms (outside it {ms - gpu_ms:+.2f})"
