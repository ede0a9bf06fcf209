"""/v1/responses through the official openai client, on the fake engine: the response and its
stream, output items (reasoning, message, function_call) from a model's text, tool loops sent
back as input items, structured output, reasoning effort and usage.

The fake engine "generates" a fixed reply (the text a model would write in its template's syntax),
so these test the wiring, not a model's skill."""

from __future__ import annotations

import json
from typing import Any

import openai
import orjson
import pydantic
from aiohttp.test_utils import TestClient

from tests.api.fakes import FakeTokenizer
from tests.api.test_openai import _close_openai_clients, engine_of, oai  # noqa: F401
from tests.api.test_tool_calls_api import HERMES_REPLY, TOOLS, XML_REPLY

TOOL: Any = {"type": "function", **TOOLS[0]["function"], "strict": False}
GEMMA_PROMPT = "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
# what may differ between two answers to one request
VOLATILE = {"id", "created_at", "completed_at", "usage", "output"}


def prompt_of(client: TestClient[Any, Any]) -> str:
    """The last submitted prompt as text (the fake tokenizer is byte-level)."""
    return FakeTokenizer().decode(engine_of(client).submitted[-1].prompt[1:])


def without_ids(output: list[Any]) -> list[dict[str, Any]]:
    return [o.model_dump(exclude={"id", "call_id"}, exclude_none=True) for o in output]


async def test_response(client: TestClient[Any, Any]) -> None:
    r = await oai(client).responses.create(
        model="x", input="Hi", instructions="Be brief.", metadata={"run": "7"}
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake-model"
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    assert r.output_text == "Hello, world!"
    [msg] = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.status == "completed"
    assert prompt_of(client) == GEMMA_PROMPT  # instructions: the system prompt, as Gemma folds it
    n_prompt = len(engine_of(client).submitted[-1].prompt)
    assert r.usage is not None and r.usage.input_tokens == n_prompt
    assert r.usage.output_tokens == len("Hello, world!") + 1  # the eos token counts
    assert r.usage.total_tokens == n_prompt + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief." and r.metadata == {"run": "7"} and r.store is False
    assert r.tool_choice == "auto" and r.tools == [] and r.previous_response_id is None


async def test_instructions_join_a_leading_developer_message(client: TestClient[Any, Any]) -> None:
    items: Any = [
        {"role": "developer", "content": "Be"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    await oai(client).responses.create(model="x", input=items, instructions="Really.")
    assert prompt_of(client) == GEMMA_PROMPT.replace("Be brief.", "Really.\nBe")


async def test_stream_events_and_final_response(client: TestClient[Any, Any]) -> None:
    api = oai(client)
    whole = await api.responses.create(model="x", input="Hi")
    async with api.responses.stream(model="x", input="Hi") as stream:
        events = [ev async for ev in stream]
        final = await stream.get_final_response()
    assert final.model_dump(exclude=VOLATILE) == whole.model_dump(exclude=VOLATILE)
    assert without_ids(final.output) == without_ids(whole.output)
    assert final.output_text == "Hello, world!"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]
    done = events[-1].response  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


async def test_raw_stream_is_named_events_without_done(client: TestClient[Any, Any]) -> None:
    r = await client.post("/v1/responses", json={"input": "Hi", "stream": True})
    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    blocks = (await r.text()).strip().split("\n\n")
    for block in blocks:
        head, data = block.split("\n")
        assert head == "event: " + orjson.loads(data[len("data: ") :])["type"]
    assert "[DONE]" not in blocks[-1]


async def qwen35(make_client: Any, reply: str, **kw: Any) -> TestClient[Any, Any]:
    client = await make_client(chat_template="qwen3.5", n_ctx=4096, reply=reply.encode(), **kw)
    return client  # type: ignore[no-any-return]


async def test_reasoning_message_and_function_call(make_client: Any) -> None:
    client = await qwen35(make_client, XML_REPLY)
    api = oai(client)
    r = await api.responses.create(model="x", input="Weather in Paris?", tools=[TOOL])
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    reasoning, msg, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "The user wants the weather." and reasoning.summary == []
    assert r.output_text == "Let me look."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert r.status == "completed"
    # the reasoning, "</think>" and the newline before it: the fake tokenizer's bytes
    assert r.usage is not None
    assert r.usage.output_tokens_details.reasoning_tokens == len(XML_REPLY.split("\n\n")[0])
    prompt = prompt_of(client)
    assert '"name": "get_weather"' in prompt and prompt.endswith("<think>\n")
    async with api.responses.stream(model="x", input="Weather in Paris?", tools=[TOOL]) as s:
        events = [ev async for ev in s]
        final = await s.get_final_response()
    assert without_ids(final.output) == without_ids(r.output)
    assert final.usage == r.usage
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == done.arguments
    assert {d.item_id for d in deltas} == {done.item_id} == {final.output[2].id}
    reasoning_text = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(reasoning_text) == "The user wants the weather."


async def test_parallel_calls_and_parallel_tool_calls_false(make_client: Any) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=4096, reply=HERMES_REPLY.encode())
    api = oai(client)
    r = await api.responses.create(model="x", input="Paris and Rome?", tools=[TOOL])
    calls = [o for o in r.output if o.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.call_id for c in calls}) == 2
    r = await api.responses.create(
        model="x", input="Paris and Rome?", tools=[TOOL], parallel_tool_calls=False
    )
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.parallel_tool_calls is False


async def test_tool_choice_none_leaves_calls_as_text(make_client: Any) -> None:
    client = await qwen35(make_client, XML_REPLY)
    r = await oai(client).responses.create(
        model="x", input="Weather?", tools=[TOOL], tool_choice="none"
    )
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output_text.startswith("Let me look.\n\n<tool_call>") and r.tool_choice == "none"


async def test_a_tool_loop_renders_as_chat_completions_does(make_client: Any) -> None:
    """The output items sent back, then the call's output: the prompt is the one the same
    conversation gets as chat messages."""
    client = await qwen35(make_client, XML_REPLY)
    api = oai(client)
    first = await api.responses.create(model="x", input="Weather in Paris?", tools=[TOOL])
    call = first.output[2]
    assert call.type == "function_call"
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"},
    ]
    await api.responses.create(model="x", input=items, tools=[TOOL], instructions="Be brief.")
    via_responses = prompt_of(client)
    fn = {"name": "get_weather", "arguments": call.arguments}
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "The user wants the weather.",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"},
    ]
    await api.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    assert via_responses == prompt_of(client)
    assert "Sunny, 25 C" in via_responses and "<parameter=city>\nParis" in via_responses


async def test_max_output_tokens_makes_an_incomplete_response(client: TestClient[Any, Any]) -> None:
    api = oai(client)
    r = await api.responses.create(model="x", input="Hi", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.max_output_tokens == 4
    assert r.output_text == "Hell" and r.output[0].status == "incomplete"  # type: ignore[union-attr]
    async with api.responses.stream(model="x", input="Hi", max_output_tokens=4) as s:
        kinds = [ev.type async for ev in s]
    assert kinds[-1] == "response.incomplete"


async def test_text_format_json_schema(make_client: Any) -> None:
    class City(pydantic.BaseModel):
        city: str

    client = await make_client(reply=b'{"city": "Paris"}')
    r = await oai(client).responses.parse(model="x", input="Where?", text_format=City)
    assert r.output_parsed == City(city="Paris")
    assert engine_of(client).submitted[-1].grammar is not None
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    await oai(client).responses.create(
        model="x", input="Where?", text={"format": {"type": "json_object"}}
    )
    assert engine_of(client).submitted[-1].grammar is not None
    await oai(client).responses.create(model="x", input="Where?", text={"format": {"type": "text"}})
    assert engine_of(client).submitted[-1].grammar is None


async def test_reasoning_effort_switches_thinking(make_client: Any) -> None:
    client = await make_client(chat_template="qwen3", n_ctx=4096)
    api = oai(client)
    r = await api.responses.create(model="x", input="Hi", reasoning={"effort": "none"})
    assert prompt_of(client).endswith("<think>\n\n</think>\n\n")  # Qwen3 with thinking off
    assert r.reasoning is not None and r.reasoning.effort == "none"
    await api.responses.create(model="x", input="Hi", reasoning={"effort": "medium"})
    assert prompt_of(client).endswith("<|im_start|>assistant\n")
    gemma = await make_client()  # no reasoning block at all: "none" is what it does anyway
    await oai(gemma).responses.create(model="x", input="Hi", reasoning={"effort": "none"})


async def test_sampling_fields_reach_the_engine(client: TestClient[Any, Any]) -> None:
    r = await oai(client).responses.create(
        model="x", input="Hi", temperature=0.25, top_p=0.5, extra_body={"top_k": 7, "seed": 3}
    )
    sp = engine_of(client).submitted[-1].sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed) == (0.25, 0.5, 7, 3)
    assert (r.temperature, r.top_p) == (0.25, 0.5)


async def test_a_failure_mid_stream_is_response_failed(make_client: Any) -> None:
    client = await make_client(fail_at=3)
    async with oai(client).responses.stream(model="x", input="Hi") as s:
        events = [ev async for ev in s]
    last = events[-1]
    assert last.type == "response.failed" and last.sequence_number == len(events) - 1
    assert last.response.status == "failed" and last.response.error is not None
    assert last.response.error.message == "generation failed: device lost"
    r = await client.post("/v1/responses", json={"input": "Hi"})
    assert r.status == 500
    assert (await r.json())["error"]["message"] == "generation failed: device lost"


async def test_store_false_and_ignored_ids_are_accepted(client: TestClient[Any, Any]) -> None:
    r = await oai(client).responses.create(
        model="x",
        input="Hi",
        store=False,
        user="u1",
        safety_identifier="s1",
        prompt_cache_key="k1",
        truncation="disabled",
    )
    assert r.output_text == "Hello, world!"


async def test_a_bad_request_is_openai_shaped(client: TestClient[Any, Any]) -> None:
    try:
        await oai(client).responses.create(model="x", input=[])
    except openai.BadRequestError as e:
        assert isinstance(e.body, dict) and e.body["param"] == "input"
        assert e.body["type"] == "invalid_request_error"
    else:
        raise AssertionError("an empty input was accepted")
