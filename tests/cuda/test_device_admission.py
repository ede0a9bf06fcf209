"""Cancellation, pinned slots and prompt progress with the device runner behind the real engine.

A request aborted mid-prompt or mid-decode (as a stop string or a disconnect does) leaves its slot
at once, while its step may still be on the runner; the next request in that slot, reusing what
the aborted one computed (for a hybrid, its whole history) or with reuse off, gives a fresh
engine's tokens. The torch backend on the CPU runs in CI against the reference engine; the CUDA
backend (gpu-marked, CUDA graphs on) against a fresh engine of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model

GREEDY = SamplingParams(temperature=0.0)
SETTINGS = Settings(parallel=2, ctx_size=160, batch_size=16)
PROMPT = list(range(20, 60))  # 40 tokens: chunks of 16, 16, 8


def _path(arch: str, tmp_path: Path) -> Path:
    from tests.cuda.test_device_models import _export

    return _export(arch, tmp_path)


def _device_engine(path: Path, device: torch.device) -> Callable[[], Engine]:
    from mgserve.cuda.backend import cuda_backend, load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    on_gpu = device.type == "cuda"
    backend = cuda_backend(0) if on_gpu else torch_backend()
    n_slots, n_ctx = SETTINGS.parallel, SETTINGS.ctx_size
    model = load_device_model(GGUFFile(path), backend, device, n_slots, n_ctx)
    return lambda: Engine(model, SETTINGS, runner=DeviceRunner(model, device, graphs=on_gpu))


async def _tokens(engine: Engine, r: Request) -> list[int]:
    return [ev.token async for ev in engine.submit(r) if ev.token is not None]


async def _fresh(make: Callable[[], Engine], prompt: list[int]) -> list[int]:
    engine = make()
    await engine.start()
    try:
        return await _tokens(engine, Request("fresh", prompt, GREEDY, 6))
    finally:
        await engine.stop()


async def _abort_then_reuse(engine: Engine) -> dict[str, Any]:
    await engine.start()
    try:
        a = engine.submit(Request("a", PROMPT, GREEDY, 50, slot=0, progress=True))
        async for ev in a:
            if ev.progress is not None and ev.progress.processed == 16:
                a.abort()  # mid-prompt: the second chunk may be on the runner
                assert engine._sched.n_busy == 0
        b = engine.submit(Request("b", PROMPT[:30], GREEDY, 50, slot=1, ignore_eos=True))
        async for ev in b:
            if ev.n_generated == 2:
                b.abort()  # mid-decode
                assert engine._sched.n_busy == 0
        # slot 0 holds a's two chunks: a hybrid reuses them too (its whole history starts PROMPT)
        c = [ev async for ev in engine.submit(Request("c", PROMPT, GREEDY, 6, slot=0))]
        assert c[0].n_cached == 32
        out = {
            "reuse": [ev.token for ev in c],
            "cold": await _tokens(
                engine, Request("d", PROMPT, GREEDY, 6, slot=1, reuse_prefix=False)
            ),
        }
        progress = [
            ev.progress
            async for ev in engine.submit(Request("e", PROMPT, GREEDY, 2, progress=True))
            if ev.progress is not None
        ]
        out["progress"] = [(p.total, p.processed) for p in progress]
        assert engine._sched.n_busy == 0 and not engine._streams
        return out
    finally:
        await engine.stop()


@pytest.mark.parametrize("arch", ["qwen3", "qwen4exp"])
@pytest.mark.usefixtures("stable_qsa_ties")
async def test_abort_and_reuse_on_the_device_runner(arch: str, tmp_path: Path) -> None:
    path = _path(arch, tmp_path)
    want = await _fresh(lambda: Engine(load_model(path, threads=1), SETTINGS), PROMPT)
    got = await _abort_then_reuse(_device_engine(path, torch.device("cpu"))())
    assert got["reuse"] == want and got["cold"] == want
    assert got["progress"][-1] == (40, 40) and got["progress"][0][1] < 40


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen4exp"])
async def test_abort_and_reuse_on_the_gpu(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    make = _device_engine(_path(arch, tmp_path), torch.device("cuda", 0))
    want = await _fresh(make, PROMPT)
    got = await _abort_then_reuse(make())
    assert got["reuse"] == want and got["cold"] == want
    assert got["progress"][-1] == (40, 40)
