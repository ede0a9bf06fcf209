"""The speculation request fields ("speculative", llama-server's "speculative.n_max" / "n_min") on
the completion, chat and /completion (and /infill's) routes: they reach the engine's Request, bad
values get a 400 naming the field, and the routes without speculation refuse them by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.http import SERVICE
from tests.api.fakes import FakeEngine

ROUTES = [
    ("/completion", {"prompt": "hi", "n_predict": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
]


def engine_of(client: TestClient[Any, Any]) -> FakeEngine:
    return client.server.app[SERVICE].engine  # type: ignore[return-value]


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize(
    ("fields", "speculative", "draft_max", "draft_min"),
    [
        ({}, True, None, 0),
        ({"speculative": False}, False, None, 0),
        ({"speculative": True, "speculative.n_max": 4}, True, 4, 0),
        ({"speculative.n_max": 8, "speculative.n_min": 3}, True, 8, 3),
        ({"speculative.n_min": 16}, True, None, 16),  # up to the server's --spec-k (16)
        ({"speculative.n_max": 0}, True, 0, 0),
        ({"speculative.n_max": 6.0}, True, 6, 0),  # JSON has one number type
        ({"speculative": None, "speculative.n_max": None}, True, None, 0),  # null: absent
    ],
)
async def test_the_fields_reach_the_request(
    make_client: Callable[..., Any],
    path: str,
    body: dict[str, Any],
    fields: dict[str, Any],
    speculative: bool,
    draft_max: int | None,
    draft_min: int,
) -> None:
    client = await make_client()
    r = await client.post(path, json=body | fields)
    assert r.status == 200, await r.text()
    req = engine_of(client).submitted[-1]
    assert (req.speculative, req.draft_max, req.draft_min) == (speculative, draft_max, draft_min)


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"speculative": "no"}, "speculative"),
        ({"speculative": 0}, "speculative"),
        ({"speculative.n_max": -1}, "speculative.n_max"),
        ({"speculative.n_max": 2.5}, "speculative.n_max"),
        ({"speculative.n_max": "4"}, "speculative.n_max"),
        ({"speculative.n_max": True}, "speculative.n_max"),
        ({"speculative.n_max": 17}, "speculative.n_max"),  # over --spec-k
        ({"speculative.n_min": -2}, "speculative.n_min"),
        ({"speculative.n_min": [1]}, "speculative.n_min"),
        ({"speculative.n_max": 2, "speculative.n_min": 3}, "speculative.n_min"),
        ({"speculative.p_min": 0.5}, "speculative.p_min"),  # llama-server's; not implemented
    ],
)
async def test_bad_values_are_a_400_naming_the_field(
    make_client: Callable[..., Any],
    path: str,
    body: dict[str, Any],
    fields: dict[str, Any],
    param: str,
) -> None:
    client = await make_client()
    r = await client.post(path, json=body | fields)
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["param"] == param and param in error["message"]
    assert not engine_of(client).submitted


async def test_completion_reports_the_bounds_in_its_settings(
    make_client: Callable[..., Any],
) -> None:
    client = await make_client()
    body = {"prompt": "hi", "n_predict": 2, "speculative.n_max": 5, "speculative.n_min": 2}
    params = (await (await client.post("/completion", json=body)).json())["generation_settings"]
    assert (params["params"]["speculative.n_max"], params["params"]["speculative.n_min"]) == (5, 2)
    props = await (await client.get("/props")).json()
    assert props["default_generation_settings"]["params"]["speculative.n_max"] == 16


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
async def test_routes_without_speculation_refuse_the_fields(
    make_client: Callable[..., Any], path: str, body: dict[str, Any]
) -> None:
    client = await make_client()
    r = await client.post(path, json=body | {"speculative": False})
    assert r.status == 400
    assert "speculative" in await r.text()
