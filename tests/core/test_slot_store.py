"""Slot save / restore / erase on the reference engine (tiny qwen3next, qwen4exp, qwen3): a slot
saved after a first turn and restored by a new engine on a reloaded model (a restart) continues
the conversation as the unsaved slot does (the same state bits: tokens, logprobs, top
candidates), reusing the whole saved history; its checkpoints come with it, so an edited turn
after the restart computes only past the nearest one and gives the cold run's answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request
from mgserve.core.engine.slot_file import model_fingerprint
from mgserve.core.engine.slot_store import SlotStore
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model
from tests.core import hybrid_export, qwen4exp_export, tiny
from tests.core.checkpoint_turns import PARAMS, SETTINGS, SYSTEM, USER1, ask, cold
from tests.core.conftest import require_chunk_invariance
from tests.core.slot_turns import EDITED_CACHED, restart_turns

MAKERS: dict[str, Callable[[Path], Path]] = {
    "qwen3next": lambda p: hybrid_export.export(
        hybrid_export.hf_model("qwen3next"), "qwen3next", p
    ),
    "qwen4exp": lambda p: qwen4exp_export.export(qwen4exp_export.hf_model(), p),
    "qwen3": lambda p: tiny.export(tiny.hf_model("qwen3"), "qwen3", p),
}


@pytest.fixture(scope="module", params=list(MAKERS))
def gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, one_thread: None
) -> Path:
    return MAKERS[request.param](tmp_path_factory.mktemp("m") / "model.gguf")


def _store(engine: Engine, directory: Path, gguf: Path) -> SlotStore:
    return SlotStore(engine, directory, model_fingerprint(GGUFFile(gguf)))


async def test_a_restored_slot_continues_as_the_saved_one(gguf: Path, tmp_path: Path) -> None:
    def new_engine() -> Engine:
        return Engine(load_model(gguf, threads=1), SETTINGS)

    t = await restart_turns(new_engine, lambda e: _store(e, tmp_path, gguf))
    assert t.n_saved == t.n_restored == t.n_held
    assert t.restored == t.live._replace(n_cached=t.n_held)  # the saved state's bits, all reused
    model = load_model(gguf, threads=1)
    assert t.edited.n_cached == EDITED_CACHED[model.rewindable]  # a checkpoint came with the file
    require_chunk_invariance(model)  # the cold runs below chunk the prompts otherwise
    assert await cold(lambda: Engine(model, SETTINGS), t.p3) == t.edited._replace(n_cached=0)
    if model.rewindable:  # a KV cache continues with the cold run's bits
        assert await cold(lambda: Engine(model, SETTINGS), t.p2) == t.live._replace(n_cached=0)


async def test_what_a_slot_file_must_match(gguf: Path, tmp_path: Path) -> None:
    model = load_model(gguf, threads=1)
    engine = Engine(model, SETTINGS)
    store = _store(engine, tmp_path, gguf)
    await engine.start()
    try:
        await ask(engine, "t1", SYSTEM + USER1)
        await store.save(0, "a.bin")
        with pytest.raises(ValueError, match="another model file"):
            await SlotStore(engine, tmp_path, "0" * 32).restore(0, "a.bin")
        with pytest.raises(ValueError, match="no slot file 'b.bin'"):
            await store.restore(0, "b.bin")
        for bad in ("../a.bin", "/tmp/a.bin", "x/a.bin", "..", ".hidden", "", "a.bin.", " a"):
            with pytest.raises(ValueError, match="invalid filename"):
                await store.save(0, bad)
        raw = (tmp_path / "a.bin").read_bytes()
        (tmp_path / "short.bin").write_bytes(raw[:-10])
        with pytest.raises(ValueError, match="not as long as"):
            await store.restore(0, "short.bin")
        (tmp_path / "junk.bin").write_bytes(b"not a slot")
        with pytest.raises(ValueError, match="not a slot file"):
            await store.restore(0, "junk.bin")
        assert (await store.restore(0, "a.bin")).n_tokens == len(SYSTEM + USER1) + 3
    finally:
        await engine.stop()
    for change, match in (
        ({"cache_type_k": "f32"}, "K cache type"),
        ({"ctx_size": 128}, "context"),
    ):
        other = Engine(model, dataclasses.replace(SETTINGS, **change))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=match):
            await _store(other, tmp_path, gguf).restore(0, "a.bin")


async def test_a_busy_slot_is_saved_after_its_request_and_erased(
    gguf: Path, tmp_path: Path
) -> None:
    model = load_model(gguf, threads=1)
    engine = Engine(model, SETTINGS)
    store = _store(engine, tmp_path, gguf)
    await engine.start()
    try:
        prompt = SYSTEM + USER1
        stream = engine.submit(Request("busy", prompt, PARAMS, max_tokens=8))
        save = asyncio.create_task(store.save(0, "busy.bin"))
        later = engine.submit(Request("later", prompt, PARAMS, max_tokens=2))  # after the save
        events = [ev async for ev in stream]
        saved = await save
        assert saved.n_tokens == len(prompt) + 7  # the whole request, not a part of it
        reused = [ev async for ev in later][-1].n_cached  # from the slot the save waited for
        assert reused == (len(prompt) - 1 if model.rewindable else 160)
        assert await store.erase(0) == len(prompt) + 1
        after = await ask(engine, "after", prompt)
        assert after.n_cached == 0
        assert events[-1].finish_reason == "length"
    finally:
        await engine.stop()
