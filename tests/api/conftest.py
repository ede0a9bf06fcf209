from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from mgserve.api.app import create_app
from mgserve.api.service import Service
from mgserve.config import Settings
from mgserve.core.text.chat import load_chat_template
from tests.api.fakes import FakeDetokenizer, FakeEngine, FakeTokenizer


def fake_service(
    api_key: str | None = None,
    n_ctx: int = 256,
    max_body_mb: int = 1,
    chat_template: str | None = None,
    tokenizer: Any = None,
    seed: int = -1,
    n_predict: int = -1,
    reasoning_format: str = "auto",
    batch_size: int = 512,
    reasoning_budget: int = -1,
    engine: Any = None,
    slot_store: Any = None,
    **engine_kw: Any,
) -> Service:
    """The fake engine (or ``engine``) behind the real API; ``chat_template`` a built-in name or a
    file, ``tokenizer`` a real one instead of the byte-level fake; ``seed``, ``n_predict``,
    ``reasoning_format``, ``batch_size``, ``reasoning_budget``: --seed, -n, --reasoning-format, -b,
    --reasoning-budget; ``slot_store``: --slot-save-path's (over ``engine``)."""
    settings = Settings(
        ctx_size=n_ctx,
        parallel=2,
        api_key=api_key,
        max_body_mb=max_body_mb,
        seed=seed,
        n_predict=n_predict,
        reasoning_format=reasoning_format,
        batch_size=batch_size,
        reasoning_budget=reasoning_budget,
    )
    tok = tokenizer or FakeTokenizer()
    return Service(
        settings=settings,
        model_id="fake-model",
        tokenizer=tok,
        chat=load_chat_template(
            chat_template, None, "gemma3", bos_token="<bos>", eos_token="<eos>"
        ),
        engine=engine or FakeEngine(n_slots=2, n_ctx=n_ctx, **engine_kw),
        n_ctx_train=n_ctx,
        n_vocab=tok.n_vocab,
        architecture="gemma3",
        model_path="/fake/model.gguf",
        new_detokenizer=lambda keep: FakeDetokenizer(tok),
        slot_store=slot_store,
    )


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., Any]]:
    """make_client(**fake_service kwargs) -> started TestClient (closed at teardown)."""
    clients: list[TestClient[Any, Any]] = []

    async def make(**kw: Any) -> TestClient[Any, Any]:
        client = TestClient(TestServer(create_app(fake_service(**kw))))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


@pytest.fixture
async def client(make_client: Callable[..., Any]) -> TestClient[Any, Any]:
    return await make_client()  # type: ignore[no-any-return]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_client(service: Any) -> AsyncIterator[TestClient[Any, Any]]:
    """A client of the module's own ``service`` fixture (a real model), for the whole module."""
    c = TestClient(TestServer(create_app(service)))
    await c.start_server()
    yield c
    await c.close()
