"""GET /openapi.json: every route the server answers, and each POST route's body exactly the
fields its handler takes: a documented field alone is never refused as unknown, a field the
document does not list always is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mgserve.api.app import create_app
from mgserve.core.engine.slot_store import SlotStore
from tests.api.conftest import fake_service
from tests.api.test_admission import real_engine


@pytest.fixture
async def served(tmp_path: Path) -> Any:
    store = SlotStore(real_engine(), tmp_path, "fp")  # --slot-save-path: the slot route's body
    async with TestClient(TestServer(create_app(fake_service(slot_store=store)))) as client:
        doc = await (await client.get("/openapi.json")).json()
        yield client, doc


def _url(path: str) -> str:
    return path.replace("{id_slot}", "0") + ("?action=restore" if "{id_slot}" in path else "")


async def test_the_document_lists_every_route(served: Any) -> None:
    client, doc = served
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "mgserve"
    app = client.server.app
    routes = {
        (r.resource.canonical, r.method.lower())
        for r in app.router.routes()
        if r.method in ("GET", "POST")
    }
    listed = {(path, m) for path, ops in doc["paths"].items() for m in ops}
    assert listed == routes and ("/v1/chat/completions", "post") in listed
    assert ("/openapi.json", "get") in listed


async def test_each_body_is_exactly_what_the_route_takes(served: Any) -> None:
    client, doc = served
    posts = {p: ops["post"] for p, ops in doc["paths"].items() if "post" in ops}
    assert len(posts) == 13 and "/infill" in posts
    del posts["/infill"]  # the fake model has no fill-in-the-middle tokens: refused before its body
    for path, op in posts.items():
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["additionalProperties"] is False
        r = await client.post(_url(path), json={"not_a_field": 1})  # the route names its fields
        takes = (await r.json())["error"]["message"].split("this route takes ")[1]
        assert set(schema["properties"]) == set(takes.split(", ")), path
        for name in schema["properties"]:  # alone it may be a bad request, but not unknown
            r = await client.post(_url(path), json={name: None, "not_a_field": 1})
            msg = (await r.json())["error"]["message"]
            assert r.status == 400 and msg.startswith("'not_a_field' is not supported"), (path, msg)
            r = await client.post(_url(path), json={name: 12345})
            if r.status == 400:
                msg = (await r.json())["error"]["message"]
                assert "is not supported" not in msg, (path, name, msg)
