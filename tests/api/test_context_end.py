"""max_tokens is bounded by the context (issue 15): a request asking for more tokens than are left
after its prompt (up to the context size) is accepted and ends at the context's end with
finish_reason "length"; one asking for more than the context size gets a 400 naming the field. On
the real engine and model (Gemma 3 270M on the CPU, a 32-token context)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
N_CTX = 32


@pytest.fixture(scope="module")
def service(gemma_path: Path) -> Iterator[Service]:
    yield build_service(Settings(model=str(gemma_path), ctx_size=N_CTX, parallel=1))


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
async def test_max_tokens_beyond_the_context_ends_with_length_at_its_end(
    client: TestClient[Any, Any], service: Service, path: str
) -> None:
    prompt = "Count: one, two, three, four,"
    n_prompt = len(service.tokenizer.encode(prompt, add_special=True))
    assert n_prompt < N_CTX // 2  # so N_CTX asks for more than is left
    asks = {"max_tokens": N_CTX} if path.startswith("/v1") else {"n_predict": N_CTX}
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True, **asks}
    if path.startswith("/v1"):
        del body["ignore_eos"]  # not an OpenAI field: EOS may end it sooner, then "stop"
    r = await client.post(path, json=body)
    assert r.status == 200, await r.text()
    out = await r.json()
    if path.startswith("/v1"):
        choice = out["choices"][0]
        n_prompt, n_out = out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]
        if choice["finish_reason"] == "stop":
            assert n_out < N_CTX - n_prompt
            return
        assert choice["finish_reason"] == "length"
    else:
        assert out["stop_type"] == "limit" and out["truncated"] is False
        n_prompt, n_out = out["tokens_evaluated"], out["tokens_predicted"]
    # the context is full when the last token is sampled (it is never fed back): one more
    # token than the context holds beside the prompt
    assert n_prompt + n_out == N_CTX + 1, (n_prompt, n_out)


@pytest.mark.parametrize(("path", "field"), [("/v1/completions", "max_tokens"),
                                            ("/completion", "n_predict")])  # fmt: skip
async def test_max_tokens_beyond_the_context_size_is_a_400_naming_it(
    client: TestClient[Any, Any], path: str, field: str
) -> None:
    r = await client.post(path, json={"prompt": "Hi", field: N_CTX + 1})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == field and "context size" in err["message"]
