"""Slot save / restore on the device runner: the conversation of tests/core/slot_turns.py (a slot
saved, a restart, the slot restored) on tiny qwen3next, qwen4exp and qwen3 device models.

Torch backend on the CPU (runs in CI; f16 and q8_0 caches): the restored slot (K/V rows, QSA
block keys, the packed recurrent state, qwen4exp's PLE token history, the checkpoints) continues
with the unsaved slot's bits, and the edited turn from the restored checkpoint gives the cold
run's. On the GPU (gpu-marked), the CUDA backend with decode graphs and a q8_0 cache: the same
turns, the largest logprob difference against the unsaved slot and the cold run printed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.slot_file import model_fingerprint
from mgserve.core.engine.slot_store import SlotStore
from mgserve.core.gguf.reader import GGUFFile
from tests.core.checkpoint_turns import SETTINGS, Answer, cold
from tests.core.slot_turns import EDITED_CACHED, Turns, restart_turns

ARCHS = ("qwen3next", "qwen4exp", "qwen3")


def _engine(path: Path, backend: Any, device: torch.device, settings: Settings) -> Engine:
    from mgserve.cuda.backend import load_device_model
    from mgserve.cuda.runner import DeviceRunner

    model = load_device_model(
        GGUFFile(path),
        backend,
        device,
        settings.parallel,
        settings.ctx_size,
        settings.cache_type_k,
        settings.cache_type_v,
    )
    runner = DeviceRunner(model, device, graphs=device.type == "cuda")
    return Engine(model, settings, runner=runner)


def _diff(a: Answer, b: Answer) -> float:
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))  # type: ignore[operator]


async def _turns(
    arch: str, root: Path, backend: Any, device: torch.device, settings: Settings
) -> tuple[Turns, Answer, bool]:
    """The turns across a restart, the edited turn's cold run, whether the model rewinds."""
    from tests.cuda.test_device_models import _export

    path = _export(arch, root)
    fingerprint = model_fingerprint(GGUFFile(path))

    def new_engine() -> Engine:
        return _engine(path, backend, device, settings)

    turns = await restart_turns(new_engine, lambda e: SlotStore(e, root, fingerprint))
    want = await cold(new_engine, turns.p3)
    rewindable = new_engine().model.rewindable
    return turns, want, rewindable


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("stable_qsa_ties")
async def test_device_slot_restored_after_a_restart(arch: str, cache: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    cpu = torch.device("cpu")
    settings = dataclasses.replace(SETTINGS, cache_type_k=cache, cache_type_v=cache)
    t, want, rewindable = await _turns(arch, tmp_path, torch_backend(), cpu, settings)
    assert t.n_saved == t.n_restored == t.n_held
    assert t.restored == t.live._replace(n_cached=t.n_held)
    assert t.edited.n_cached == EDITED_CACHED[rewindable]
    assert want == t.edited._replace(n_cached=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
async def test_gpu_slot_restored_after_a_restart(arch: str, tmp_path: Path, cuda_ops: Any) -> None:
    dev = torch.device("cuda", 0)
    settings = dataclasses.replace(SETTINGS, cache_type_k="q8_0", cache_type_v="q8_0")
    t, want, rewindable = await _turns(arch, tmp_path, cuda_ops, dev, settings)
    print(
        f"{arch}: restored {t.n_restored} tokens; max |logprob diff| restored vs unsaved slot "
        f"{_diff(t.restored, t.live):.3g}, edited turn vs cold {_diff(t.edited, want):.3g}"
    )
    assert t.n_saved == t.n_restored == t.n_held
    assert t.restored.n_cached == t.n_held and t.restored.tokens == t.live.tokens
    assert _diff(t.restored, t.live) < 1e-3  # the same state and kernels: expected bit for bit
    assert t.edited.n_cached == EDITED_CACHED[rewindable]
    assert t.edited.tokens == want.tokens and _diff(t.edited, want) < 1e-3


def test_save_stream_on_the_cpu_copies_at_once() -> None:
    from mgserve.cuda.save_stream import SaveStream

    src = torch.arange(8.0)
    got = SaveStream(torch.device("cpu")).copy(0, {"x": src[:4]})
    src.fill_(-1.0)
    assert torch.equal(got["x"], torch.arange(4.0))


@pytest.mark.gpu
def test_gpu_slot_save_copies_beside_the_steps() -> None:
    """512 MiB copied on the save stream: the call returns before the copy ends; a step writing
    the slot afterwards (the compute stream) waits for it on the device, so the copy holds the
    values from before."""
    import time

    from mgserve.cuda.save_stream import SaveStream

    dev = torch.device("cuda", 0)
    src = torch.arange(1 << 27, dtype=torch.int32, device=dev)
    saves = SaveStream(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = saves.copy(3, {"x": src})
    queued = time.perf_counter() - t0
    saves.before([3])
    src.fill_(-1)  # queued on the compute stream behind the save
    t1 = time.perf_counter()
    x = got["x"]  # waits for the copy
    waited = time.perf_counter() - t1
    print(f"512 MiB save: queued in {queued * 1e3:.2f} ms, then {waited * 1e3:.2f} ms to the end")
    assert x.is_pinned()
    assert torch.equal(x[-3:], torch.arange((1 << 27) - 3, 1 << 27, dtype=torch.int32))
    assert torch.equal(x[:3], torch.arange(3, dtype=torch.int32))
    torch.cuda.synchronize()
    assert bool((src == -1).all())
