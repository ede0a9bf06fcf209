"""What hostile input cannot reach: with --api-key every route but the health probes refuses
without the key (401 JSON; llama-server also leaves /models and /v1/models open, mgserve does not:
the model list names the file served), a GGUF chat template cannot reach Python's internals or the
file system, and a slot file name cannot leave the --slot-save-path directory."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from mgserve.api.app import PUBLIC_PATHS, create_app
from mgserve.core.engine.slot_store import SlotStore
from mgserve.core.text import chat_limits
from mgserve.core.text.chat import load_chat_template
from tests.api.conftest import fake_service
from tests.api.test_admission import real_engine

KEY = "s3cret-key"


def _paths(app: web.Application) -> list[tuple[str, str]]:
    """Every route of the app, as (method, a path that matches it)."""
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter", "").replace("{id_slot}", "0")
        if route.method != "HEAD":
            out.append((route.method, path))
    return out


async def test_every_route_but_health_needs_the_key(make_client: Any) -> None:
    client = await make_client(api_key=KEY)
    routes = _paths(client.server.app)
    assert ("GET", "/metrics") in routes and ("POST", "/slots/0") in routes
    assert len(routes) >= 20
    refused = 0
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY[:-1]},
            {"X-Api-Key": KEY + "x"},
            {"Authorization": f"Basic {KEY}"},
        ):
            r = await client.request(method, path, headers=headers, json={})
            if path in PUBLIC_PATHS:
                assert r.status == 200, (path, await r.text())
                continue
            assert r.status == 401, (method, path, headers, r.status)
            assert r.content_type == "application/json"
            assert (await r.json())["error"]["type"] == "authentication_error"
            refused += 1
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}):
            r = await client.request(method, path, headers=headers, json={})
            assert r.status != 401, (method, path)
    assert refused == 5 * (len(routes) - len(PUBLIC_PATHS))
    # an unknown path is refused as well, before it can tell what exists
    assert (await client.get("/nope")).status == 401
    assert PUBLIC_PATHS == {"/health", "/v1/health"}


EVIL = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__['__builtins__']['__import__']('os').system('id') }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ strftime_now.__globals__ }}",
    "{{ messages.pop.__self__ }}",
    "{{ 'x' | attr('__cl' ~ 'ass__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '%s' % ''.__class__ }}",
    "{% import 'os' as os %}{{ os.getcwd() }}",
    "{% from 'os' import getcwd %}{{ getcwd() }}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{% include 'a.jinja' ignore missing %}",
]


@pytest.mark.parametrize("src", EVIL)
async def test_a_gguf_template_cannot_reach_python_or_files(src: str) -> None:
    service = fake_service()
    # as build_service reads it from the GGUF's tokenizer.chat_template
    service.chat = load_chat_template(None, src, "gemma3", bos_token="<bos>", eos_token="<eos>")
    async with TestClient(TestServer(create_app(service))) as client:
        msgs = [{"role": "user", "content": "x"}]
        for path, body in (
            ("/apply-template", {"messages": msgs}),
            ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
        ):
            r = await client.post(path, json=body)
            text = await r.text()
            if r.status == 400:  # a clear template error
                msg = (await r.json())["error"]["message"]
                assert msg.startswith("chat template error"), msg
                assert "SecurityError" in msg or "undefined" in msg, msg
            else:  # or the unsafe part rendered as nothing
                assert r.status == 200, text
            for leak in ("root:", "<class", "<function", "<module", "<built-in", os.getcwd()):
                assert leak not in text, (src, text)


# templates that would run for hours or build gigabytes: each ends in a clear error, fast
NS = "{% set ns = namespace(s='x', l=[1]) %}"
RUNAWAY = [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "longer"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     "longer"),
    (NS + "{% for i in range(99) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "text"),
    (NS + "{% for i in range(99) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "sequence"),
    (NS + "{% for i in range(99) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "sequence"),
    ("{% macro m() %}{% for i in range(99999) %}{{ 'x' * 1000000 }}{% endfor %}{% endmacro %}"
     "{% set t = m() %}", "output"),
    ("{% set t %}{% for i in range(99999) %}{{ 'y' * 1000000 }}{% endfor %}{% endset %}", "output"),
    ("{% for i in range(99999) %}{{ 'z' * 1000 }} text {{ i }}{% endfor %}", "output"),
    ("{{ (['x' * 1000000] * 1000) | join }}", "joined"),
    ("{{ ''.join(['x' * 1000000] * 1000) }}", "joined"),
    ("{{ ([[0] * 1000000] * 1000) | join }}", "joined"),
    ("{{ [[0] * 1000000] * 1000 }}", "text"),
    ("{{ 'a' ~ [[0] * 1000000] * 1000 }}", "text"),
    ("{{ ([[0] * 1000000] * 1000) | tojson }}", "text"),
    ("{{ ('x' * 100000) | replace('x', 'x' * 100000) }}", "replaced"),
    ("{{ ('x' * 100000).replace('x', 'y' * 100000) }}", "replaced"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("src", "why"), RUNAWAY, ids=[f"{i}-{w}" for i, (_, w) in enumerate(RUNAWAY)]
)
async def test_a_runaway_template_ends_in_a_clear_error(
    src: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_limits, "RENDER_SECONDS", 1.0)
    monkeypatch.setattr(chat_limits, "MAX_TEXT", 1 << 24)  # 16 M characters: fast to hit
    service = fake_service()
    service.chat = load_chat_template(None, src, "gemma3", bos_token="<bos>", eos_token="<eos>")
    async with TestClient(TestServer(create_app(service))) as client:
        t0 = time.monotonic()
        body = {"messages": [{"role": "user", "content": "x"}]}
        r = await client.post("/apply-template", json=body)
        assert time.monotonic() - t0 < 8.0
        assert r.status == 400, await r.text()
        msg = (await r.json())["error"]["message"]
        assert msg.startswith("chat template error: SecurityError") and why in msg, msg
        assert (await client.get("/health")).status == 200  # and the server goes on


def test_the_budget_leaves_real_templates_alone() -> None:
    """Loops, macros, joins and replaces of ordinary size render as before, budget or not."""
    src = (
        "{% macro r(m) %}{{ m.role | upper }}: {{ m.content | replace('a', 'A') }}{% endmacro %}"
        "{% for m in messages %}{{ r(m) ~ '|' }}{% endfor %}{{ messages | map(attribute='role') "
        "| join(',') }}{{ ['p', 'q'] + ['s'] }}{{ 'ab' + 'c' }}{{ ', '.join(['u', 'v']) }}"
    )
    chat = load_chat_template(None, src, "gemma3")
    msgs = [{"role": "user", "content": "banana"}, {"role": "assistant", "content": "a"}]
    assert chat.apply(msgs) == "USER: bAnAnA|ASSISTANT: A|user,assistant['p', 'q', 's']abcu, v"


@pytest.fixture
def store(tmp_path: Path) -> SlotStore:
    (tmp_path / "slots").mkdir()
    (tmp_path / "outside.bin").write_bytes(b"secret")
    (tmp_path / "slots" / "link.bin").symlink_to(tmp_path / "outside.bin")
    return SlotStore(real_engine(), tmp_path / "slots", "fp")


ESCAPES = [
    "../x.bin", "..", ".", "/etc/passwd", "a/../../x", "a\x00b", "x.bin\x00/../../y", "..\\x",
    "~/x", "link.bin", " x", "x ", ".hidden", "a" * 256, "", "x\n", "C:x",
]  # fmt: skip


@pytest.mark.parametrize("name", ESCAPES)
def test_slot_names_cannot_leave_the_directory(store: SlotStore, name: str) -> None:
    with pytest.raises(ValueError, match="invalid filename"):
        store.path(name)


@settings(max_examples=300, deadline=None)
@given(name=st.text(min_size=0, max_size=40))
def test_any_slot_name_stays_in_the_directory(tmp_path_factory: Any, name: str) -> None:
    directory = tmp_path_factory.getbasetemp() / "anyslots"
    directory.mkdir(exist_ok=True)
    s = SlotStore(real_engine(), directory, "fp")
    try:
        path = s.path(name)
    except ValueError:
        return
    assert path.resolve().parent == directory.resolve() and path.name == name
