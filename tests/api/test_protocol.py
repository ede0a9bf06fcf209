"""The API boundary: a body becomes the engine's ``Request`` here, checked and with every default
resolved (protocol.engine_request), so the engine neither checks nor fills in anything again."""

from __future__ import annotations

from typing import Any

import pytest

from mgserve.api.errors import ApiError
from mgserve.api.protocol import engine_request, llama_params, openai_params
from tests.api.conftest import fake_service
from tests.api.fakes import EOS, EOT


@pytest.mark.parametrize(
    ("server_seed", "body", "seed"),
    [
        (-1, {}, None),  # random per session: the runner draws one
        (-1, {"seed": 7}, 7),
        (5, {}, 5),  # --seed when the request gives none
        (5, {"seed": -1}, 5),  # llama-server's "random" is the server's default too
        (5, {"seed": 7}, 7),
    ],
)
def test_the_seed_is_resolved_at_the_boundary(
    server_seed: int, body: dict[str, Any], seed: int | None
) -> None:
    service = fake_service(seed=server_seed)
    assert llama_params(body, service).sampling.seed == seed
    assert openai_params(body, True, service).sampling.seed == seed


@pytest.mark.parametrize(
    ("n_predict", "body", "n_prompt", "max_tokens"),
    [
        (-1, {}, 10, 54),  # to the context end: 64 - 10
        (20, {}, 10, 20),  # --n-predict
        (100, {}, 10, 54),  # --n-predict, but no further than the context end
        (20, {"n_predict": 3}, 10, 3),  # the request's own
        (20, {"n_predict": -1}, 10, 20),  # llama-server's -1: the server's default
    ],
)
def test_max_tokens_is_resolved_at_the_boundary(
    n_predict: int, body: dict[str, Any], n_prompt: int, max_tokens: int
) -> None:
    service = fake_service(n_ctx=64, n_predict=n_predict)
    req = engine_request(service, llama_params(body, service), list(range(1, n_prompt + 1)))
    assert req.max_tokens == max_tokens
    assert req.stop_token_ids == {EOS, EOT} and req.prompt == list(range(1, n_prompt + 1))


def test_a_request_the_engine_could_not_run_never_reaches_it() -> None:
    service = fake_service(n_ctx=16)
    params = openai_params({}, True, service)
    with pytest.raises(ApiError, match="empty") as e:
        engine_request(service, params, [], "messages")
    assert (e.value.status, e.value.param) == (400, "messages")
    with pytest.raises(ApiError, match="has 16 tokens; the context holds 16") as e:
        engine_request(service, params, list(range(16)))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    req = engine_request(service, params, list(range(15)))  # one token left to generate
    assert req.max_tokens == 1
    ids = {engine_request(service, params, [1]).id for _ in range(3)}
    assert len(ids) == 3  # the engine refuses an id in use; the boundary never reuses one
