"""The device runner's prefill lane (``DeviceRunner(lanes=True)``, cuda/runner.py) on tiny
qwen3next and qwen4exp models, under tests/core/mixed_load.py's load: two sessions decode while a
third's long prompt is chunked in the lane (checkpoints moved to host memory by the lane's
batches; the last prompt token alone, on the decode kernels in the lane).

Torch backend on the CPU (runs in CI): the two lanes' threads really run at once, and every
request's tokens and logprobs are bitwise those of the sequential runner. On the GPU (gpu-marked),
the CUDA backend with decode graphs on the decoders' high-priority stream: the same equality, and
the decode steps complete while a chunk is still running on the lane's stream, by CUDA events
(each chunk is made to last ``SPIN_MS`` longer by a spinning kernel queued before it, so the
overlap does not depend on how fast a tiny model is)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.engine.actor import Engine
from mgserve.core.gguf.reader import GGUFFile
from tests.core.mixed_load import LANE_CHUNKS, LANE_DECODE, LANE_PROMPT, LANE_SETTINGS, Out, serve

ARCHS = ("qwen3next", "qwen4exp")
SPIN_MS = 200


def _model(arch: str, root: Path, backend: Any, device: torch.device) -> Any:
    from mgserve.cuda.backend import load_device_model
    from tests.cuda.test_device_models import _export

    g = GGUFFile(_export(arch, root))
    return load_device_model(g, backend, device, LANE_SETTINGS.parallel, LANE_SETTINGS.ctx_size)


async def _serve(model: Any, device: torch.device, lanes: bool) -> tuple[Out, list[int], Any]:
    from mgserve.cuda.runner import DeviceRunner

    runner = DeviceRunner(model, device, graphs=device.type == "cuda", lanes=lanes)
    engine = Engine(model, LANE_SETTINGS, runner=runner)
    assert engine.lanes == lanes
    out, chunks = await serve(engine, LANE_PROMPT, LANE_DECODE)
    return out, chunks, runner


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("stable_qsa_ties")
async def test_the_lane_gives_the_sequential_bits_on_the_cpu(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    cpu = torch.device("cpu")
    model = _model(arch, tmp_path, torch_backend(), cpu)
    seq, seq_chunks, _ = await _serve(model, cpu, lanes=False)
    got, chunks, _ = await _serve(model, cpu, lanes=True)
    assert chunks == seq_chunks == LANE_CHUNKS
    assert got == seq
    assert [len(t) for t in got.values()] == [LANE_DECODE, LANE_DECODE, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
async def test_gpu_decode_steps_complete_while_a_chunk_runs(
    arch: str, tmp_path: Path, cuda_ops: Any, spin: Any
) -> None:
    dev = torch.device("cuda", 0)
    model = _model(arch, tmp_path, cuda_ops, dev)
    seq, _, _ = await _serve(model, dev, lanes=False)

    from mgserve.cuda.runner import DeviceRunner

    runner = DeviceRunner(model, dev, lanes=True)
    chunks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    decoded: list[tuple[torch.cuda.Event, set[int]]] = []  # a decode step's end, its slots
    prompted: list[set[int]] = []  # each chunk's slots

    def event() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # on the calling thread's current stream: its lane's
        return ev

    prefill, decode, run = runner._prefill, runner._decode, runner.run
    hosted: list[tuple[str, float, float]] = []  # (thread, start, end): each runner step's host

    def timed_run(batch: Any) -> Any:  # where the host was, for a failure's message
        t0 = time.perf_counter()
        try:
            return run(batch)
        finally:
            kind = "lane" if batch.lane else "decoders"
            hosted.append((f"{kind}@{threading.current_thread().name}", t0, time.perf_counter()))

    def spun_prefill(work: Any, window: Any = None) -> torch.Tensor:
        if not chunks:
            hosted.append(("origin", time.perf_counter(), 0.0))
        start = event()
        spin(cuda_ops.kernels.stream(), SPIN_MS * 1_000_000)
        logits = prefill(work, window)
        chunks.append((start, event()))
        prompted.append({w.slot for w in work})
        return logits

    def timed_decode(work: Any, step: Any) -> torch.Tensor:
        logits = decode(work, step)
        if step is runner.decode:  # the decoders' graphs (not a prompt's last token)
            decoded.append((event(), {w.slot for w in work}))
        return logits

    runner.run = timed_run  # type: ignore[method-assign]
    runner._prefill = spun_prefill  # type: ignore[method-assign]
    runner._decode = timed_decode  # type: ignore[method-assign]
    engine = Engine(model, LANE_SETTINGS, runner=runner)
    with StackSampler() as sampled:
        got, _ = await serve(engine, LANE_PROMPT, LANE_DECODE)
    torch.cuda.synchronize()
    assert got == seq  # the lanes change when tokens come, not which

    origin = chunks[0][0]
    t_decoded = [origin.elapsed_time(ev) for ev, _ in decoded]
    prompt = set().union(*prompted[1:])  # the lane's prompt, decoded after its last chunk
    t_decoders = [origin.elapsed_time(ev) for ev, slots in decoded if slots - prompt]
    overlapped = 0
    for i, (start, end) in enumerate(chunks[1:]):  # p's chunks (the first: the decoders' prompts)
        t0, t1 = origin.elapsed_time(start), origin.elapsed_time(end)
        inside = [t for t in t_decoded if t0 < t < t1]
        later = [t for t in t_decoders if t > t0]  # the decoders may be done before a late chunk
        gaps = [b - a for a, b in zip(inside, inside[1:], strict=False)]
        print(f"{arch} chunk {i}: {t1 - t0:.1f} ms on the GPU, {len(inside)} decode steps "
              f"completed inside, the longest gap {max(gaps, default=0):.1f} ms")  # fmt: skip
        assert t1 - t0 >= SPIN_MS and len(inside) >= min(5, len(later))
        assert max(gaps, default=0) < SPIN_MS / 4, _host_steps(hosted, t0, t1, sampled)
        overlapped += len(inside) >= 5
    assert overlapped  # at least one chunk ran beside the decoders


def _host_steps(
    hosted: list[tuple[str, float, float]], t0: float, t1: float, sampled: StackSampler
) -> str:
    """The runner steps' host intervals (ms from the first chunk's start on the host, by thread)
    around a chunk's GPU interval [t0, t1] (ms on the GPU's clock, from the same start), and
    where the decoders' thread's Python stack was during its longest step: where the decoders'
    thread was while its steps stopped completing."""
    origin = next(start for name, start, _ in hosted if name == "origin")
    near = [(n, 1e3 * (a - origin), 1e3 * (b - origin)) for n, a, b in hosted if n != "origin"]
    rows = [f"{n} {a:.1f}-{b:.1f}" for n, a, b in near if t0 - 20 <= a <= t1]
    decoders = [(b - a, a, b) for n, a, b in near if n.startswith("decoders") and t0 - 20 <= a]
    _, a, b = max(decoders, default=(0.0, 0.0, 0.0))
    stacks = sampled.during(origin + a / 1e3, origin + b / 1e3)
    return "host steps (thread start-end ms): " + "; ".join(rows) + "\n" + stacks


class StackSampler:
    """Samples every runner thread's Python stack each millisecond (``sys._current_frames``), so
    a failure can say where a thread was while it was slow; a gap in the sampler's own ticks
    means some thread held the GIL inside a C call."""

    def __init__(self, every_s: float = 0.001) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, str, tuple[str, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import sys

        names = {}
        while not self._stop.wait(self.every_s):
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                name = names.get(ident, "?")
                if not name.startswith("mgserve-"):
                    continue
                stack = []
                f: Any = frame
                while f is not None and len(stack) < 8:
                    code = f.f_code
                    stack.append(f"{Path(code.co_filename).name}:{f.f_lineno} {code.co_name}")
                    f = f.f_back
                self.samples.append((now, name, tuple(stack)))

    def during(self, a: float, b: float) -> str:
        """The sampled stacks of the runner threads between host times ``a`` and ``b``, each
        distinct stack once with how many samples it had, and the sampler's longest tick."""
        from collections import Counter

        inside = [(t, n, s) for t, n, s in self.samples if a <= t <= b]
        ticks = sorted({t for t, _, _ in inside})
        longest = max((y - x for x, y in zip(ticks, ticks[1:], strict=False)), default=0.0)
        counts = Counter((n, s) for _, n, s in inside)
        lines = [f"stacks sampled {1e3 * (b - a):.1f} ms (longest tick {1e3 * longest:.1f} ms):"]
        for (n, s), c in counts.most_common(8):
            lines.append(f"  {c} x {n}: " + " <- ".join(s))
        return "\n".join(lines)


@pytest.mark.gpu
def test_gpu_upfront_graphs_run_the_decode_kernels(tmp_path: Path, cuda_ops: Any) -> None:
    """With lanes every bucket up to the slots is captured when the runner is made, outside any
    step: those captures must run the decode kernels as a graph captured at its first step does
    (inside ``path.step("decode")``). They once took the prompt GEMMs for buckets above 8 rows,
    so a session's bits depended on how many others decoded beside it. A dense model's decode
    step at the same positions is idempotent, so both runners replay from one state."""
    from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
    from mgserve.cuda.backend import load_device_model
    from mgserve.cuda.graphs import DecodeInputs
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    dev = torch.device("cuda", 0)
    model = load_device_model(GGUFFile(_export("qwen3", tmp_path)), cuda_ops, dev, 11, 256)
    up = DeviceRunner(model, dev, lanes=True)  # buckets of 1..10 rows captured here
    lazy = DeviceRunner(model, dev)  # captured at their first step
    greedy = SamplingParams(temperature=0.0)
    prompts = tuple(
        SeqWork(
            slot=s,
            request_id=f"r{s}",
            tokens=(5 + s, 6, 7),
            start=0,
            sample=False,
            sampling=greedy,
            new_sequence=True,
        )  # fmt: skip
        for s in range(9)
    )
    lazy.run(ScheduledBatch(1, prompts))
    inp = DecodeInputs(tokens=[50 + s for s in range(9)], pos=[3] * 9, slots=list(range(9)),
                       extra=None)  # fmt: skip
    with model.backend.path.step("decode"):
        want = lazy.decode(inp).clone()
    got = up.decode(inp).clone()  # its bucket was captured up front
    assert up.decode.ready(9) and torch.equal(got, want)
