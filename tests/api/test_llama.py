"""llama-server's native routes on the fake engine."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp.test_utils import TestClient

from mgserve.api.http import SERVICE
from tests.api.fakes import BOS, EOS, SOT, FakeEngine
from tests.prom import metric


def engine_of(client: TestClient[Any, Any]) -> FakeEngine:
    return client.server.app[SERVICE].engine  # type: ignore[return-value]


async def sse_events(resp: Any) -> list[Any]:
    """Parse an SSE body into its data payloads ([DONE] kept as the string)."""
    body = (await resp.read()).decode()
    assert body.endswith("\n\n")
    out = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


async def test_completion_with_timings_and_n_probs(client: TestClient[Any, Any]) -> None:
    resp = await client.post(
        "/completion", json={"prompt": "Hi", "n_predict": 4, "n_probs": 2, "return_tokens": True}
    )
    assert resp.status == 200
    r = await resp.json()
    assert r["content"] == "Hell" and r["stop"] is True and r["stop_type"] == "limit"
    assert r["tokens"] == list(b"Hell")
    assert r["tokens_predicted"] == 4 and r["tokens_evaluated"] == 3
    assert r["model"] == "fake-model" and r["prompt"] == "<bos>Hi"
    assert r["id_slot"] in (0, 1)
    t = r["timings"]
    assert t["prompt_n"] == 3 and t["predicted_n"] == 4 and t["cache_n"] == 0
    assert t["predicted_ms"] > 0 and t["prompt_ms"] > 0
    assert abs(t["predicted_per_token_ms"] * 4 - t["predicted_ms"]) < 1e-6
    assert abs(t["predicted_per_second"] - 4000 / t["predicted_ms"]) < 1e-6
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == list(b"Hell")
    assert probs[0] == {
        "id": ord("H"),
        "token": "H",
        "bytes": [ord("H")],
        "logprob": -0.25,
        "top_logprobs": [
            {"id": ord("H"), "token": "H", "bytes": [ord("H")], "logprob": -0.25},
            {"id": ord("I"), "token": "I", "bytes": [ord("I")], "logprob": -1.25},
        ],
    }
    assert engine_of(client).submitted[-1].prompt == [BOS, *b"Hi"]


async def test_completion_eos_and_stop_word(client: TestClient[Any, Any]) -> None:
    r = await (await client.post("/completions", json={"prompt": "Hi"})).json()
    assert r["content"] == "Hello, world!" and r["stop_type"] == "eos"
    assert "completion_probabilities" not in r
    r = await (await client.post("/completion", json={"prompt": "x", "stop": ", w"})).json()
    assert r["content"] == "Hello" and r["stop_type"] == "word" and r["stopping_word"] == ", w"


async def test_completion_stream(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/completion", json={"prompt": "Hi", "stream": True, "n_probs": 1})
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    assert "[DONE]" not in events  # llama-server ends with the stop:true object
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == "Hello, world!"
    assert all(len(e["completion_probabilities"]) == 1 for e in events[:-1])
    last = events[-1]
    assert last["stop"] is True and last["stop_type"] == "eos"
    assert last["timings"]["predicted_n"] == 14


async def test_completion_mixed_prompt(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/completion", json={"prompt": [SOT, "ab", 7], "n_predict": 1})
    assert resp.status == 200
    assert engine_of(client).submitted[-1].prompt == [SOT, *b"ab", 7]
    await client.post("/completion", json={"prompt": ["ab", 7], "n_predict": 1})
    assert engine_of(client).submitted[-1].prompt == [BOS, *b"ab", 7]


async def test_completion_logit_bias_forms(client: TestClient[Any, Any]) -> None:
    bias = [[65, 1.5], ["B", False], ["67", -2]]
    await client.post("/completion", json={"prompt": "x", "n_predict": 1, "logit_bias": bias})
    sp = engine_of(client).submitted[-1].sampling
    assert sp.logit_bias == ((65, 1.5), (66, float("-inf")), (67, -2.0))


async def test_tokenize_detokenize(client: TestClient[Any, Any]) -> None:
    r = await (await client.post("/tokenize", json={"content": "a<eos>"})).json()
    assert r["tokens"] == [ord("a"), EOS]  # parse_special defaults to true, add_special false
    r = await (
        await client.post(
            "/tokenize",
            json={
                "content": "é<eos>",
                "add_special": True,
                "parse_special": False,
                "with_pieces": True,
            },
        )
    ).json()
    assert r["tokens"][0] == {"id": BOS, "piece": "<bos>"}
    assert r["tokens"][1] == {"id": 0xC3, "piece": [0xC3]}  # half a character: raw bytes
    assert "".join(p["piece"] for p in r["tokens"][3:]) == "<eos>"
    r = await (await client.post("/detokenize", json={"tokens": [*"hé".encode(), EOS]})).json()
    assert r == {"content": "hé<eos>"}


async def test_apply_template(client: TestClient[Any, Any]) -> None:
    r = await (
        await client.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
    ).json()
    assert r == {"prompt": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"}


async def test_health_props_slots_metrics(client: TestClient[Any, Any]) -> None:
    assert await (await client.get("/health")).json() == {"status": "ok"}
    props = await (await client.get("/props")).json()
    assert props["total_slots"] == 2 and props["n_ctx"] == 256
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert "<start_of_turn>" in props["chat_template"]
    assert props["model_path"] == "/fake/model.gguf" and "mgserve" in props["build_info"]
    slots = await (await client.get("/slots")).json()
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    await client.post("/completion", json={"prompt": "x", "n_predict": 2})
    resp = await client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert metric(text, "mgserve_requests_submitted_total") == 1
    assert metric(text, "llamacpp:requests_processing") == 0


async def test_slots_fail_on_no_slot_as_llama_server(make_client: Any) -> None:
    client = await make_client(reply=b"", step_s=0.01)
    engine: FakeEngine = client.server.app[SERVICE].engine
    hold = {"prompt": "x", "n_predict": 200, "ignore_eos": True, "stream": True}
    first = await client.post("/completion", json=hold)
    await first.content.readline()
    assert (await client.get("/slots?fail_on_no_slot=1")).status == 200  # one slot is free
    second = await client.post("/completion", json=hold)
    await second.content.readline()
    assert engine.busy() == 2
    r = await client.get("/slots?fail_on_no_slot=1")
    assert r.status == 503 and (await r.json())["error"]["message"] == "no slot available"
    assert (await client.get("/slots")).status == 200
    r = await client.get("/slots?fail_on_no_slots=1")
    assert r.status == 400 and (await r.json())["error"]["param"] == "fail_on_no_slots"
    first.close()
    second.close()


async def test_engine_error_is_reported_not_hidden(make_client: Any) -> None:
    client = await make_client(fail_at=3)
    resp = await client.post("/completion", json={"prompt": "x"})
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "generation failed: device lost"
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    events = await sse_events(resp)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Hel"
    assert events[-1]["error"]["message"] == "generation failed: device lost"
