"""``--activations``: which decode products a GPU server runs on int8 activations (auto: models of
1 GiB of weights or more), and the CPU engine refusing an explicit int8."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgserve.config import Settings
from mgserve.cuda.backend import INT8_MIN_BYTES, int8_activations


class _Tensor:
    def __init__(self, n_bytes: int) -> None:
        self.n_bytes = n_bytes


class _File:
    def __init__(self, *sizes: int) -> None:
        self.tensors = {f"t{i}": _Tensor(n) for i, n in enumerate(sizes)}


def test_auto_picks_int8_by_the_weights_bytes() -> None:
    small, large = _File(INT8_MIN_BYTES // 2, 1000), _File(INT8_MIN_BYTES // 2, INT8_MIN_BYTES // 2)
    assert not int8_activations(small, "auto")  # type: ignore[arg-type]
    assert int8_activations(large, "auto")  # type: ignore[arg-type]
    assert int8_activations(small, "int8")  # type: ignore[arg-type]
    assert not int8_activations(large, "exact")  # type: ignore[arg-type]


def test_the_setting_and_its_refusals(tmp_path: Path) -> None:
    from mgserve.core.engine.factory import load_engine

    assert Settings().activations == "auto"
    with pytest.raises(ValueError, match="activations"):
        Settings(activations="int4")
    from tests.cuda.test_device_models import _export

    path = str(_export("qwen3", tmp_path))
    with pytest.raises(ValueError, match="--activations int8 is for the GPU runner"):
        load_engine(Settings(model=path, device="cpu", activations="int8"))
    assert load_engine(Settings(model=path, device="cpu", activations="exact")).engine is not None


@pytest.mark.gpu
def test_a_gpu_server_runs_the_activations_asked_for(tmp_path: Path) -> None:
    """On the GPU the engine's backend multiplies int8 activations with ``int8``, fp32 with
    ``exact`` and with ``auto`` for a tiny model; a greedy request is served either way."""
    import asyncio

    from mgserve.core.engine.factory import load_engine
    from tests.cuda.test_device_models import _export

    path = str(_export("qwen3", tmp_path))
    for mode, want in (("int8", True), ("exact", False), ("auto", False)):
        loaded = load_engine(Settings(model=path, device="cuda", activations=mode, ctx_size=128))
        assert loaded.engine._runner.model.backend.linear.int8 is want, mode

        assert len(asyncio.run(_ask(loaded.engine))) == 4


async def _ask(engine) -> list[int]:
    from mgserve.core.engine.contract import Request, SamplingParams

    await engine.start()
    try:
        req = Request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0), 4, ignore_eos=True)
        return [e.token async for e in engine.submit(req) if e.token is not None]
    finally:
        await engine.stop()
