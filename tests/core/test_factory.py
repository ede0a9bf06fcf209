"""The engine factory: the one way from settings to an engine, and where ``ctx_size`` 0 (the
model's trained context) becomes a number, once, before anything is sized from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgserve.config import Settings
from mgserve.core.engine.runner import ReferenceRunner
from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf

FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen4exp.gguf"


def test_settings_for_model_resolves_only_ctx_size_zero() -> None:
    assert Settings(ctx_size=0).for_model(8192).ctx_size == 8192
    explicit = Settings(ctx_size=256)
    assert explicit.for_model(8192) is explicit


@pytest.mark.parametrize(("ctx_size", "n_ctx"), [(0, None), (64, 64)])
def test_load_engine_on_the_cpu(ctx_size: int, n_ctx: int | None) -> None:
    from mgserve.core.engine.factory import load_engine

    engine, g, device = load_engine(
        Settings(model=str(FILE), ctx_size=ctx_size, parallel=1, device="cpu")
    )
    trained = hybrid_spec_from_gguf(g)[0].n_ctx_train
    assert device == "cpu" and g.path == FILE
    assert engine.n_ctx == engine.settings.ctx_size == (n_ctx or trained)
    assert isinstance(engine._runner, ReferenceRunner) and engine._runner.n_ctx == engine.n_ctx
