"""/infill end to end on the CPU path: a tiny random qwen2 model carrying Qwen2.5-Coder's
vocabulary (tests/core/coder_vocab.py), so the server finds the FIM tokens in the file as it
would in the real one, builds the prompt, and the engine completes it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings
from tests.api.test_llama import sse_events
from tests.core.coder_vocab import tiny_coder

pytestmark = pytest.mark.asyncio(loop_scope="module")
BODY = {
    "input_prefix": "def add(a, b):\n",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "prompt": "    ",
    "input_extra": [{"filename": "util.py", "text": "ONE = 1\n"}],
    "n_predict": 6,
    "temperature": 0,
    "ignore_eos": True,
    "return_tokens": True,
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = tiny_coder(tmp_path_factory.mktemp("coder") / "coder.gguf")
    yield build_service(
        Settings(model=str(path), ctx_size=256, batch_size=64, parallel=2, device="cpu")
    )


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def test_infill_is_the_completion_of_its_fim_prompt(
    client: TestClient[Any, Any], service: Service
) -> None:
    resp = await client.post("/infill", json=BODY)
    assert resp.status == 200, await resp.text()
    r = await resp.json()
    assert r["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>util.py\nONE = 1\n")
    assert r["prompt"].endswith("    <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>")
    assert r["tokens_predicted"] == 6 and r["stop_type"] == "limit"
    # the same ids through /completion give the same greedy middle
    ids = (await (await client.post("/tokenize", json={"content": r["prompt"]})).json())["tokens"]
    assert len(ids) == r["tokens_evaluated"]
    assert ids[-1] == service.tokenizer.fim.mid
    body = {k: BODY[k] for k in ("n_predict", "temperature", "ignore_eos", "return_tokens")}
    plain = await (await client.post("/completion", json={"prompt": ids, **body})).json()
    assert plain["tokens"] == r["tokens"] and plain["content"] == r["content"]


async def test_infill_streams(client: TestClient[Any, Any]) -> None:
    whole = await (await client.post("/infill", json=BODY)).json()
    resp = await client.post("/infill", json={**BODY, "stream": True})
    events = await sse_events(resp)
    assert events[-1]["stop"] is True
    assert [t for e in events for t in e["tokens"]] == whole["tokens"]
