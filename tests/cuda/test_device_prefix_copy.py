"""Prefix copy on the device runner: the scenarios of tests/core/copy_turns.py on tiny qwen3next,
qwen4exp and qwen3 device models (``snapshots.copy_prefix``: K/V rows, q8_0 scales, QSA block
keys, the packed recurrent state and qwen4exp's PLE token history).

Torch backend on the CPU (runs in CI; f16 and q8_0 caches): the second session, copied from the
decoding first one, answers as a fresh device engine does, bit for bit, and the first as if
alone; a live copy answers as the source slot itself does. On the GPU (gpu-marked), the CUDA
backend with decode graphs and a q8_0 cache: the same, with the largest logprob differences
printed (a copied checkpoint gives the cold run's chunks and kernels: expected bit for bit).
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
from tests.core.checkpoint_turns import Answer
from tests.core.copy_turns import COPIED, COPY_SETTINGS, N_A, N_B, A, B, alone, beside, pinned
from tests.prom import metric

ARCHS = ("qwen3next", "qwen4exp", "qwen3")


def _factory(
    arch: str, root: Path, backend: Any, device: torch.device, settings: Settings
) -> tuple[Any, bool]:
    """A function making engines on one device model of ``arch``; whether the model rewinds."""
    from mgserve.cuda.backend import load_device_model
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    g = GGUFFile(_export(arch, root))
    s = settings
    model = load_device_model(
        g, backend, device, s.parallel, s.ctx_size, s.cache_type_k, s.cache_type_v
    )

    def new() -> Engine:
        return Engine(model, s, runner=DeviceRunner(model, device, graphs=device.type == "cuda"))

    return new, model.rewindable


async def _scenarios(new: Any) -> tuple[Answer, Answer, Answer, Answer, float | None]:
    """A and B beside each other, a second turn copied live and in its own slot, copies made."""
    engine = new()
    await engine.start()
    try:
        a, b = await beside(engine)
        copies = metric(engine.metrics.registry, "mgserve_prefix_copies_total")
    finally:
        await engine.stop()
    turns = []
    for slot in (1, 0):
        engine = new()
        await engine.start()
        try:
            turns.append(await pinned(engine, slot))
        finally:
            await engine.stop()
    return a, b, turns[0], turns[1], copies


def _diff(x: Answer, y: Answer) -> float:
    return max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True))  # type: ignore[operator]


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("stable_qsa_ties")
async def test_device_prefix_copy_answers_as_cold(arch: str, cache: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    settings = dataclasses.replace(COPY_SETTINGS, cache_type_k=cache, cache_type_v=cache)
    new, rewindable = _factory(arch, tmp_path, torch_backend(), torch.device("cpu"), settings)
    a, b, live, own, copies = await _scenarios(new)
    assert copies == 1 and b.n_cached == COPIED[rewindable]
    assert await alone(new, B, N_B) == b._replace(n_cached=0)
    assert await alone(new, A, N_A) == a
    assert live == own and live.n_cached == len(A) + N_B - 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
async def test_gpu_prefix_copy(arch: str, tmp_path: Path, cuda_ops: Any) -> None:
    settings = dataclasses.replace(COPY_SETTINGS, cache_type_k="q8_0", cache_type_v="q8_0")
    new, rewindable = _factory(arch, tmp_path, cuda_ops, torch.device("cuda", 0), settings)
    a, b, live, own, copies = await _scenarios(new)
    want_b, want_a = await alone(new, B, N_B), await alone(new, A, N_A)
    print(
        f"{arch}: copied {b.n_cached}; max |logprob diff| copied vs cold {_diff(b, want_b):.3g}, "
        f"source vs alone {_diff(a, want_a):.3g}, live copy vs own slot {_diff(live, own):.3g}"
    )
    assert copies == 1 and b.n_cached == COPIED[rewindable]
    assert b.tokens == want_b.tokens and a.tokens == want_a.tokens
    assert live.tokens == own.tokens and live.n_cached == own.n_cached
    assert _diff(live, own) < 1e-3  # the same state and kernels: expected bit for bit
    if not rewindable:  # a checkpoint: the cold run's chunks and kernels
        assert _diff(b, want_b) < 1e-3
