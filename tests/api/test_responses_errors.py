"""/v1/responses refusals: every field or item the server would not honour gets a 400 in
OpenAI's error shape naming the field, with a message that says why."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.errors import ApiError
from mgserve.api.responses_inputs import responses_input

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
THOUGHT = [{"type": "reasoning_text", "text": "t"}]
REASONING = {"type": "reasoning", "summary": [], "content": THOUGHT}
IMAGE = {"type": "input_image", "image_url": "http://x/y.png"}
SCHEMA_FMT = {"type": "json_schema", "name": "x"}

CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"input": None}, "input", "must be a string or a non-empty list"),
    ({"input": 3}, "input", "must be a string or a non-empty list"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not keep"),
    ({"store": True}, "store", "keeps no responses"),
    ({"background": True}, "background", "not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"stop": ["x"]}, "stop", "not supported"),
    ({"n": 2}, "n", "not supported"),
    ({"truncation": "auto"}, "truncation", "'auto' is not supported"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options", "obfuscation"),
    ({"instructions": ["x"]}, "instructions", "must be a string"),
    ({"metadata": {"k": 1}}, "metadata", "must be strings"),
    ({"max_output_tokens": 0}, "max_output_tokens", "must be in [1, "),
    ({"temperature": -1}, "temperature", "must be in [0.0, inf]"),
    ({"text": {"verbosity": "low"}}, "text", "only 'medium'"),
    ({"text": {"verbosity": 1}}, "text", "only 'medium'"),
    ({"text": {"format": {}, "style": "x"}}, "text", "text.style is not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "include_usage is not"),
    ({"text": {"format": SCHEMA_FMT}}, "text", "text.format must be an object with a 'schema'"),
    ({"text": {"format": {"type": "yaml"}}}, "text", "type 'yaml' is not supported"),
    ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text", "a JSON schema"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "does not summarize"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning budget"),
    ({"reasoning": {"effort": "huge"}}, "reasoning", "must be one of"),
    ({"reasoning": {"effort": "medium"}}, "reasoning", "does not reason"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].name must be a string"),
    ({"tools": [TOOL | {"strict": "yes"}]}, "tools", "tools[0].strict must be a boolean"),
    ({"tools": [TOOL]}, "tools", "writes no tool calls"),  # the Gemma template
    ({"tool_choice": "required"}, "tool_choice", "has no 'tools'"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "has no 'tools'"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "name must be a string"),
    ({"tool_choice": "any"}, "tool_choice", "takes 'auto', 'none', 'required'"),
    ({"tools": {"type": "function"}}, "tools", "'tools' must be a list"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice", "'allowed_tools' is not"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be one of"),
    ({"input": [{"role": "user", "content": [IMAGE]}]}, "input", "read text only"),
    ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input", "input[0].name is"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "stored responses"),
    ({"input": [{"type": "computer_call"}]}, "input", "item type 'computer_call'"),
    ({"input": [CALL | {"arguments": {}}]}, "input", "input[0].arguments must be a string"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c1", "output": 5}]},
        "input",
        "input[0].output must be a string or a list of text parts",
    ),
    ({"input": [REASONING | {"encrypted_content": "x"}]}, "input", "no encrypted reasoning"),
    ({"input": ["Hi", REASONING]}, "input", "input[0] must be an object"),
    ({"input": [{"role": "user", "content": "x"}, REASONING]}, "input", "without the answer"),
    ({"input": [REASONING, {"role": "user", "content": "x"}]}, "input", "just before"),
    ({"input": "x" * 300}, "input", "the context holds 256"),
]


@pytest.mark.parametrize(("fields", "param", "says"), CASES)
async def test_refused(
    client: TestClient[Any, Any], fields: dict[str, Any], param: str, says: str
) -> None:
    r = await client.post("/v1/responses", json={"model": "x", "input": "Hi"} | fields)
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert says in err["message"], err["message"]


def test_reasoning_effort_none_needs_a_thinking_switch() -> None:
    body = {"input": "Hi", "reasoning": {"effort": "none"}}
    assert responses_input(body, True, True).chat.kwargs == {"enable_thinking": False}
    assert responses_input(body, False, False).chat.kwargs == {}  # never reasons: honoured
    with pytest.raises(ApiError, match="always reasons"):
        responses_input(body, False, True)
    body["reasoning"] = {"effort": "medium"}
    assert responses_input(body, True, True).chat.kwargs == {"enable_thinking": True}
    assert responses_input(body, False, True).chat.kwargs == {}  # it reasons anyway
