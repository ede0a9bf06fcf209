"""Recurrent-state checkpoints on the device runner: the conversation of
tests/core/checkpoint_turns.py on tiny qwen3next and qwen4exp device models.

Torch backend on the CPU (runs in CI): the device runner's checkpoints (the pools' recurrent views
packed, qwen4exp's PLE token history beside them) restore to the cold run's bits, and the
answers are the reference engine's tokens. On the GPU (gpu-marked), the CUDA backend with decode
graphs, one checkpoint per slot in device memory so the others go through pinned host memory: the
answers restored from a checkpoint against a cold device run (the same chunks and kernels, so
expected bit for bit), every turn's largest logprob difference printed (the second turn continues
a live state past decoded tokens: rounding apart).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model
from tests.core.checkpoint_turns import LIVE_TURN, RECURRENT_CACHED, SETTINGS, cold, conversation
from tests.prom import metric

ARCHS = ("qwen3next", "qwen4exp")


def _model(arch: str, root: Path, backend: Any, device: torch.device) -> tuple[Any, Path]:
    from mgserve.cuda.backend import load_device_model
    from tests.cuda.test_device_models import _export

    path = _export(arch, root)
    g = GGUFFile(path)
    return load_device_model(g, backend, device, SETTINGS.parallel, SETTINGS.ctx_size), path


def _engine(model: Any, device: torch.device, settings: Settings = SETTINGS) -> Engine:
    from mgserve.cuda.runner import DeviceRunner

    return Engine(model, settings, runner=DeviceRunner(model, device, graphs=device.type == "cuda"))


async def _turns(model: Any, device: torch.device, settings: Settings) -> tuple[Any, Any, Any]:
    engine = _engine(model, device, settings)
    await engine.start()
    try:
        prompts, answers = await conversation(engine)
        return prompts, answers, engine.metrics.registry
    finally:
        await engine.stop()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("stable_qsa_ties")
async def test_device_checkpoints_restore_the_cold_run(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    cpu = torch.device("cpu")
    model, path = _model(arch, tmp_path, torch_backend(), cpu)
    prompts, answers, metrics = await _turns(model, cpu, SETTINGS)
    assert [a.n_cached for a in answers] == RECURRENT_CACHED
    assert metric(metrics, "mgserve_checkpoint_restores_total") == 2
    ref = load_model(path, threads=1)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        want = await cold(lambda: _engine(model, cpu), p)
        assert want.tokens == a.tokens
        if i != LIVE_TURN:
            assert want == a._replace(n_cached=0)
        assert (await cold(lambda: Engine(ref, SETTINGS), p)).tokens == a.tokens


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
async def test_gpu_checkpoints_through_host_memory(
    arch: str, tmp_path: Path, cuda_ops: Any
) -> None:
    dev = torch.device("cuda", 0)
    model, _ = _model(arch, tmp_path, cuda_ops, dev)
    settings = dataclasses.replace(SETTINGS, ctx_checkpoints=1)
    prompts, answers, metrics = await _turns(model, dev, settings)
    assert [a.n_cached for a in answers] == RECURRENT_CACHED
    assert metric(metrics, "mgserve_checkpoint_host_bytes")
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        want = await cold(lambda: _engine(model, dev), p)
        diff = max(abs(x - y) for x, y in zip(want.logprobs, a.logprobs, strict=True))
        print(f"{arch} turn {i}: reused {a.n_cached}, max |logprob diff| vs cold {diff:.3g}")
        if i != LIVE_TURN:  # the cold run's chunks and kernels: expected bit for bit
            assert want.tokens == a.tokens and diff < 1e-3
