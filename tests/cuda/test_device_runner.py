"""The device runner behind the real engine: greedy requests give the reference engine's tokens.

Torch backend on the CPU (runs in CI): the runner's split of a step into prefill spans and a decode
batch, slot bookkeeping, prefix reuse (a rewindable KV cache starts past the shared prefix; a
recurrent state restarts), penalty windows and device sampling all meet the scheduler here. Four
requests run concurrently (three slots: one waits for a slot), then one again alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model

GREEDY = SamplingParams(temperature=0.0)
PENALIZED = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16)
SETTINGS = Settings(parallel=3, ctx_size=160, batch_size=16)


def _export(arch: str, path: Path) -> Path:
    from tests.cuda.test_device_models import _export as export

    return export(arch, path.parent)


def _requests() -> list[Request]:
    base = list(range(20, 60))
    return [
        Request("a", base, GREEDY, max_tokens=6),
        Request("b", base[:25] + [7, 8, 9], PENALIZED, max_tokens=5),
        Request("c", list(range(90, 97)), GREEDY, max_tokens=7),
        Request("d", base + [3, 4], GREEDY, max_tokens=4),  # extends a's history
    ]


async def _serve(engine: Engine, reqs: list[Request]) -> dict[str, list[int]]:
    await engine.start()
    try:

        async def one(r: Request) -> tuple[str, list[int]]:
            toks = [ev.token async for ev in engine.submit(r) if ev.token is not None]
            return r.id, toks

        return dict(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        await engine.stop()


@pytest.mark.parametrize("arch", ["qwen3", "qwen4exp"])
@pytest.mark.usefixtures("stable_qsa_ties")
async def test_device_runner_serves_like_the_reference(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    path = _export(arch, tmp_path / f"{arch}.gguf")
    ref = await _serve(Engine(load_model(path, threads=1), SETTINGS), _requests())
    cpu = torch.device("cpu")
    model = load_device_model(
        GGUFFile(path), torch_backend(), cpu, SETTINGS.parallel, SETTINGS.ctx_size
    )
    runner = DeviceRunner(model, cpu, graphs=False)
    got = await _serve(Engine(model, SETTINGS, runner=runner), _requests())
    assert got == ref
    again = await _serve(Engine(model, SETTINGS, runner=runner), _requests()[2:3])
    assert again["c"] == ref["c"]


def test_runner_rejects_the_spare_slot(tmp_path: Path) -> None:
    from mgserve.core.engine.contract import ScheduledBatch, SeqWork
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    path = _export("qwen3", tmp_path / "m.gguf")
    cpu = torch.device("cpu")
    model = load_device_model(GGUFFile(path), torch_backend(), cpu, 2, 32)
    runner = DeviceRunner(model, cpu, graphs=False)
    work = SeqWork(2, "x", (5, 6), 0, True, GREEDY, new_sequence=True)  # slot 2 is the spare
    with pytest.raises(ValueError, match="slot 2 out of range"):
        runner.run(ScheduledBatch(1, (work,)))


@pytest.mark.usefixtures("stable_qsa_ties")
def test_packed_ple_rows_give_the_float_rows_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt chunk's PLE rows travel packed (as the table stores them) and are decoded where
    the PLE layer runs: every request's tokens are those of the float32 rows."""
    from mgserve.core.reference import ple_rows
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    path = _export("qwen4exp", tmp_path / "m.gguf")
    cpu = torch.device("cpu")
    packed: list[torch.Tensor] = []
    pack = ple_rows.packed_rows

    def spy(t, rows):  # type: ignore[no-untyped-def]
        packed.append(out := pack(t, rows))
        return out

    def tokens() -> dict[str, list[int]]:
        model = load_device_model(GGUFFile(path), torch_backend(), cpu, 3, 160)
        runner = DeviceRunner(model, cpu, graphs=False)
        return asyncio.run(_serve(Engine(model, SETTINGS, runner=runner), _requests()))

    monkeypatch.setattr(ple_rows, "packed_rows", spy)
    got = tokens()
    assert packed and all(p is not None and p.dtype == torch.uint8 for p in packed)
    monkeypatch.setattr(ple_rows, "packed_rows", lambda t, rows: None)  # float32 rows throughout
    assert got == tokens()
