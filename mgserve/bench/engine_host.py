"""``mgserve bench engine-host``: the engine's own time per decode step, on the CPU.

Between two decode steps the GPU waits for the host: the step's result handed from the runner's
thread to the engine's event loop, applied (stop conditions, metrics, the streams' events), the
next batch planned and handed back to the runner's thread. That part of a served step is the
engine's, whatever the model; this measures it alone: the engine as the server runs it (its
actor on uvloop, the runner on its thread) with a runner that returns every step at once (one
token a session, never a stop), ``--sessions`` sessions of ``--tokens`` tokens each, their
streams read as a client's would be. Beside it, the bare cost of one hand-off to a thread and
back on the same loop, which a step pays once. The model file only gives the engine its
vocabulary and template (no forward runs).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a GGUF file or built-in name (default: the built-in)")
    parser.add_argument("--sessions", default="1,5,16", help="comma-separated session counts")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens a session")


class InstantRunner:
    """A runner whose steps take no time: one token (42) for each session that samples."""

    lanes = False
    checkpoint_nbytes = 0
    slot_format = "none"

    def __init__(self) -> None:
        self.steps = 0

    def run(self, batch: Any) -> Any:
        from mgserve.core.engine.contract import SeqResult, StepResult

        self.steps += 1
        res = [SeqResult(w.slot, w.request_id, 42, None, ()) for w in batch.work if w.sample]
        return StepResult(batch.step, res, n_tokens=sum(len(w.tokens) for w in batch.work))


def _run(main: Callable[[], Coroutine[Any, Any, float]]) -> float:
    try:
        import uvloop
    except ImportError:  # as the server: asyncio where uvloop has no build
        return asyncio.run(main())
    return uvloop.run(main())


def _steps(model: Any, sessions: int, tokens: int) -> tuple[float, int]:
    """Microseconds a step and the steps of ``sessions`` sessions of ``tokens`` tokens."""
    from mgserve.config import Settings
    from mgserve.core.engine.actor import Engine
    from mgserve.core.engine.contract import Request, SamplingParams

    runner = InstantRunner()
    settings = Settings(parallel=sessions, ctx_size=tokens + 64, batch_size=512)

    async def main() -> float:
        engine = Engine(model, settings, runner=runner)  # type: ignore[arg-type]
        await engine.start()
        try:
            t0 = time.perf_counter()
            greedy = SamplingParams(temperature=0.0)
            streams = [
                engine.submit(Request(f"r{i}", [5, 6, 7], greedy, max_tokens=tokens))
                for i in range(sessions)
            ]

            async def read(stream: Any) -> int:
                return sum([1 async for _ in stream])

            got = await asyncio.gather(*(read(s) for s in streams))
            if sum(got) != sessions * tokens:
                raise RuntimeError(f"engine-host: {sum(got)} tokens, {sessions * tokens} asked")
            return time.perf_counter() - t0
        finally:
            await engine.stop()

    seconds = _run(main)
    return seconds / runner.steps * 1e6, runner.steps


def _handoff_us(n: int = 5000) -> float:
    """One hand-off to a thread and back, as the engine's loop makes it, in microseconds."""

    async def main() -> float:
        loop, ex = asyncio.get_running_loop(), ThreadPoolExecutor(1)
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                await asyncio.wait({loop.run_in_executor(ex, int)})
            return (time.perf_counter() - t0) / n * 1e6
        finally:
            ex.shutdown()

    return _run(main)


def run(args: argparse.Namespace) -> int:
    from mgserve.bench import record
    from mgserve.core.builtin_models import resolve_model
    from mgserve.core.models import load_model

    sessions = [int(x) for x in args.sessions.split(",")]
    if not sessions or min(sessions) < 1 or args.tokens < 1:
        raise ValueError("engine-host: --sessions and --tokens must be positive")
    path = resolve_model(args.model)
    model = load_model(path, threads=1)
    lines = [
        f"The engine's time per decode step (a runner that returns at once; {path.name}'s "
        f"vocabulary, {args.tokens} tokens a session, greedy; the event loop as served)",
        "",
        "| sessions | steps | us a step | of it, one hand-off to a thread and back |",
        "| --- | --- | --- | --- |",
    ]
    handoff = _handoff_us()
    for s in sessions:
        us, steps = _steps(model, s, args.tokens)
        lines.append(f"| {s} | {steps} | {us:.1f} | {handoff:.1f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.record:
        record("the engine's time per decode step (CPU)", "\n".join(lines))
    return 0
