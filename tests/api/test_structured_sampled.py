"""A hundred sampled answers under a JSON schema, all parsed and validated: through the whole
server (``response_format`` on /v1/completions, the engine, the sampler's masks) on the converted
tiny llama of tests/data (random weights, a byte-level vocabulary of 320 tokens), so the hundred
fit in seconds on the CPU; on a GPU machine the same service runs the device runner."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.service import Service, build_service
from mgserve.config import Settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LLAMA = Path(__file__).resolve().parent.parent / "data" / "converted_llama.gguf"
# every valid document is at most ~60 bytes (a 4-character string of \uXXXX escapes at worst),
# so max_tokens below never cuts one off on this byte-level vocabulary
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
        "w": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "n", "tag", "w"],
    "additionalProperties": False,
}
N_SAMPLED = 100


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    # all hundred are sent at once: the queue holds the 84 that wait for a slot
    settings = Settings(model=str(LLAMA), ctx_size=128, parallel=16, threads=1, max_queue=N_SAMPLED)
    yield build_service(settings)


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


async def test_a_hundred_sampled_answers_all_parse_and_validate(
    client: TestClient[Any, Any],
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    body = {"prompt": "JSON:", "max_tokens": 80, "temperature": 1.0, "top_p": 1.0, "min_p": 0,
            "response_format": fmt}  # fmt: skip

    async def one(seed: int) -> tuple[str, str]:
        r = await (await client.post("/v1/completions", json=body | {"seed": seed})).json()
        return r["choices"][0]["text"], r["choices"][0]["finish_reason"]

    outs = await asyncio.gather(*(one(seed) for seed in range(N_SAMPLED)))
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in outs}) > N_SAMPLED // 2, outs  # sampled, not one answer
