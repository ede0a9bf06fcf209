"""POST /slots/{id}?action=save|restore|erase over a real engine (tiny qwen3 on the reference
path): llama-server's answers and refusals, and a slot saved by one server and restored by a new
one (a restart), whose next /completion reuses every saved token and answers as the first server
did."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.config import Settings, settings_from
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.slot_file import model_fingerprint
from mgserve.core.engine.slot_store import SlotStore
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model
from tests.core import tiny
from tests.core.checkpoint_turns import SETTINGS, SYSTEM, USER1, USER2

PROMPT = SYSTEM + USER1


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.export(tiny.hf_model("qwen3"), "qwen3", tmp_path_factory.mktemp("m") / "m.gguf")


@pytest.fixture
def serve(gguf: Path, tmp_path: Path, make_client: Callable[..., Any]) -> Callable[..., Any]:
    """serve(save=True) -> a client of a new server on the model (its slot files in tmp_path)."""

    async def make(save: bool = True) -> TestClient[Any, Any]:
        engine = Engine(load_model(gguf, threads=1), SETTINGS)
        fingerprint = model_fingerprint(GGUFFile(gguf))
        store = SlotStore(engine, tmp_path, fingerprint) if save else None
        return await make_client(engine=engine, slot_store=store)  # type: ignore[no-any-return]

    return make


async def _complete(client: TestClient[Any, Any], prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "id_slot": 0, "return_tokens": True}
    r = await client.post("/completion", json=body)
    assert r.status == 200, await r.text()
    return await r.json()  # type: ignore[no-any-return]


async def _error(r: Any, status: int, param: str | None) -> str:
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert err["param"] == param
    return err["message"]  # type: ignore[no-any-return]


async def test_save_restart_restore(serve: Callable[..., Any], tmp_path: Path) -> None:
    client = await serve()
    first = await _complete(client, PROMPT)
    r = await client.post("/slots/0?action=save", json={"filename": "conv.bin"})
    saved = await r.json()
    n = len(PROMPT) + 3  # the prompt and the answer's tokens fed back
    assert saved["id_slot"] == 0 and saved["filename"] == "conv.bin" and saved["n_saved"] == n
    assert saved["n_written"] == (tmp_path / "conv.bin").stat().st_size
    assert saved["timings"]["save_ms"] > 0
    p2 = PROMPT + first["tokens"] + USER2  # the next turn
    second = await _complete(client, p2)

    client = await serve()  # a restart
    r = await client.post("/slots/0?action=restore", json={"filename": "conv.bin"})
    restored = await r.json()
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    assert restored["id_slot"] == 0 and restored["timings"]["restore_ms"] > 0
    again = await _complete(client, p2)
    assert again["timings"]["cache_n"] == second["timings"]["cache_n"] == n
    assert again["tokens"] == second["tokens"] and again["content"] == second["content"]
    r = await client.post("/slots/0?action=erase")
    assert await r.json() == {"id_slot": 0, "n_erased": len(p2) + 3}
    assert (await _complete(client, PROMPT))["timings"]["cache_n"] == 0


async def test_refusals(serve: Callable[..., Any]) -> None:
    off = await serve(save=False)
    r = await off.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert "--slot-save-path" in await _error(r, 501, None)
    client = await serve()
    await _error(await client.post("/slots/x?action=erase"), 400, "id_slot")
    await _error(await client.post("/slots/1?action=erase"), 400, "id_slot")  # one slot
    await _error(await client.post("/slots/0?action=load", json={}), 400, "action")
    await _error(await client.post("/slots/0?action=save", json={}), 400, "filename")
    for bad in ("../a.bin", "/etc/a.bin", "d/a.bin", "..", ".a.bin", ""):
        r = await client.post("/slots/0?action=save", json={"filename": bad})
        assert "Invalid filename" in await _error(r, 400, "filename")
    r = await client.post("/slots/0?action=restore", json={"filename": "nope.bin"})
    assert "no slot file 'nope.bin'" in await _error(r, 400, "filename")
    r = await client.post("/slots/0?action=save", json={"filename": "a.bin", "other": 1})
    assert "other" in await _error(r, 400, "other")


def test_the_save_path_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MGSERVE_SLOT_SAVE_PATH", str(tmp_path))
    assert settings_from().slot_save_path == str(tmp_path)
    with pytest.raises(ValueError, match="slot-save-path is not a directory"):
        Settings(slot_save_path=str(tmp_path / "missing"))
