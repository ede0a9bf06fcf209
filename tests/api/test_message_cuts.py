"""Message cut hints (api/message_cuts.py) on the tiny converted qwen3next: two chats sharing a
system prompt, one after the other in the same slot and in another slot (a prefix copy of the
first's checkpoint at the hint), reuse exactly the system block and answer as a cold run does;
a boundary inside a token gives no hint; a model that takes no checkpoints gets none.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.chat_inputs import chat_inputs
from mgserve.api.message_cuts import MIN_HINT, boundaries, message_cuts
from mgserve.api.prompts import encode_text, render_chat
from mgserve.api.service import Service, build_service
from mgserve.config import Settings
from mgserve.core.text.chat import BUILTIN, ChatTemplate

FILE = Path(__file__).resolve().parents[1] / "data" / "converted_qwen3next.gguf"
SETTINGS = Settings(
    model=str(FILE),
    ctx_size=512,
    parallel=2,
    device="cpu",
    batch_size=16,
    checkpoint_every=32,
    prefix_copy_min=16,
)
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 12}
GREEDY = {"max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    yield build_service(SETTINGS)


@pytest.fixture(scope="module")
def client(module_client: TestClient[Any, Any]) -> TestClient[Any, Any]:
    return module_client


def chat(user: str, system: dict[str, str] = SYSTEM) -> dict[str, Any]:
    return {"messages": [system, {"role": "user", "content": user}]}


def hints_of(service: Any, body: dict[str, Any]) -> tuple[tuple[int, ...], list[int], str]:
    inputs = chat_inputs(body)
    text = render_chat(service, inputs)
    ids = encode_text(service, text)
    return message_cuts(service, inputs, text, ids), ids, text


async def ask(client: TestClient[Any, Any], body: dict[str, Any]) -> tuple[Any, int]:
    resp = await client.post("/v1/chat/completions", json={**body, **GREEDY})
    assert resp.status == 200, await resp.text()
    got = await resp.json()
    return got["choices"][0]["logprobs"], got["timings"]["cache_n"]


def test_the_system_block_ends_a_hint(service: Service) -> None:
    (h,), ids, text = hints_of(service, chat("Hello there"))
    head = b"".join(service.tokenizer.piece(t) for t in ids[:h]).decode()
    assert text.startswith(head) and head.endswith("<|im_start|>user\n")
    assert SYSTEM["content"] in head and h % 16  # not where chunks end anyway
    assert boundaries([SYSTEM, {"role": "user"}, {"role": "assistant"}, {"role": "user"}]) == [1, 3]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("slots", [(0, 0), (0, 1)])
async def test_a_second_chat_reuses_the_system_block_and_answers_cold(
    client: TestClient[Any, Any], service: Service, slots: tuple[int, int]
) -> None:
    system = {"role": "system", "content": f"{slots} " + SYSTEM["content"]}  # new to both slots
    first, second = chat("Hello there", system), chat("What now?", system)
    (h,), _, _ = hints_of(service, second)
    assert hints_of(service, first)[0] == (h,)
    _, n0 = await ask(client, {**first, "id_slot": slots[0]})
    warm, n1 = await ask(client, {**second, "id_slot": slots[1]})
    cold, n2 = await ask(client, {**second, "id_slot": 1 - slots[1], "cache_prompt": False})
    assert (n0, n1, n2) == (0, h, 0)
    assert warm == cold  # tokens, logprobs, top candidates: bit for bit


class _Chars:
    """A tokenizer that joins a newline to the character after it."""

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return [hash(t) % 1000 for t in re.findall(r"\n?[^\n]|\n", text)]


def _stub(cut_hints: bool) -> Any:
    return SimpleNamespace(
        chat=ChatTemplate("chatml", BUILTIN["chatml"]),
        tokenizer=_Chars(),
        engine=SimpleNamespace(cut_hints=cut_hints, n_ctx=4096),
        max_token_bytes=8,
    )


def test_a_boundary_inside_a_token_gives_no_hint() -> None:
    assert hints_of(_stub(True), chat("\nHello"))[0][0] >= MIN_HINT  # "\n" | "\nH": splits
    assert hints_of(_stub(True), chat("Hello"))[0] == ()  # "\nH" spans the boundary


def test_a_model_without_checkpoints_gets_no_hints() -> None:
    assert hints_of(_stub(False), chat("\nHello"))[0] == ()
