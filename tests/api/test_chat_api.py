"""Chat requests as current OpenAI clients and llama-server clients send them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

CHAT = "/v1/chat/completions"
TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
USER = {"role": "user", "content": "Hi"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


async def template(client: TestClient[Any, Any], **body: Any) -> Any:
    resp = await client.post("/apply-template", json=body)
    return resp.status, await resp.json()


async def test_developer_role_is_the_system_prompt(make_client: Any) -> None:
    client = await make_client(chat_template="chatml")
    _, dev = await template(client, messages=[{"role": "developer", "content": "Be terse."}, USER])
    _, sys = await template(client, messages=[{"role": "system", "content": "Be terse."}, USER])
    assert dev["prompt"] == sys["prompt"]
    assert dev["prompt"].startswith("<|im_start|>system\nBe terse.<|im_end|>")
    resp = await client.post(
        CHAT, json={"messages": [{"role": "developer", "content": "x"}, USER], "max_tokens": 2}
    )
    assert resp.status == 200


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
        ({"type": "file", "file": {"file_id": "f"}}, "file"),
    ],
)
async def test_multimodal_parts_are_refused_naming_the_type(
    client: TestClient[Any, Any], part: dict[str, Any], kind: str
) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    resp = await client.post(CHAT, json={"messages": [{"role": "user", "content": content}]})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == "messages"
    assert f"messages[0].content[1]: content part type '{kind}' is not supported" in err["message"]


async def test_text_parts_are_joined(make_client: Any) -> None:
    client = await make_client(chat_template="chatml")
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    _, out = await template(client, messages=[{"role": "user", "content": parts}])
    assert "<|im_start|>user\none\ntwo<|im_end|>" in out["prompt"]


async def test_chat_template_kwargs_reach_the_template(make_client: Any) -> None:
    client = await make_client(chat_template="qwen3")
    _, on = await template(client, messages=[USER])
    _, off = await template(
        client, messages=[USER], chat_template_kwargs={"enable_thinking": False}
    )
    assert on["prompt"].endswith("<|im_start|>assistant\n")
    assert off["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    body = {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}
    assert (await client.post(CHAT, json=body | {"max_tokens": 2})).status == 200
    _, no_gen = await template(client, messages=[USER], add_generation_prompt=False)
    assert no_gen["prompt"] == "<|im_start|>user\nHi<|im_end|>\n"


async def test_tool_conversation_with_string_arguments(make_client: Any) -> None:
    # Qwen 3.5's own template iterates the arguments as a mapping
    client = await make_client(chat_template=str(TEMPLATES / "Qwen3.5-4B.jinja"), n_ctx=4096)
    status, out = await template(client, messages=TOOL_TURNS, tools=TOOLS)
    assert status == 200, out
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in out["prompt"]
    body = {"messages": TOOL_TURNS, "tools": TOOLS, "max_tokens": 2}
    assert (await client.post(CHAT, json=body)).status == 200


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs", "boolean"),
        ({"tool_choice": "required"}, "tool_choice", "has no 'tools'"),
        ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "tool_choice", "'name' string"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            "tool_choice",
            "names 'nope', which is not",
        ),
        ({"tool_choice": "required", "tools": TOOLS}, "tools", "writes no tool calls"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        ({"tool_choice": "any", "tools": TOOLS}, "tool_choice", "must be 'auto'"),
        ({"reasoning_format": "deepseek-legacy"}, "reasoning_format", "one of none"),
        ({"tools": [1]}, "tools", "list of objects"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt", "boolean"),
    ],
)
async def test_bad_template_inputs(
    client: TestClient[Any, Any], body: dict[str, Any], param: str, says: str
) -> None:
    resp = await client.post(CHAT, json={"messages": [USER]} | body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, {"messages": [USER], "reasoning_effort": "low"}, "reasoning_effort"),
        (CHAT, {"messages": [USER], "functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"messages": [USER], "grammar": "root ::= 'a'"}, "grammar"),
        ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
        ("/v1/completions", {"prompt": "a", "best_of": 2}, "best_of"),
        ("/completion", {"prompt": "a", "mirostat": 2}, "mirostat"),
        ("/completion", {"prompt": "a", "n_keep": 4}, "n_keep"),
        ("/tokenize", {"content": "a", "add_bos": True}, "add_bos"),
        ("/detokenize", {"tokens": [1], "skip_special": True}, "skip_special"),
        ("/apply-template", {"messages": [USER], "temperature": 0.5}, "temperature"),
    ],
)
async def test_unimplemented_fields_are_refused_by_name(
    client: TestClient[Any, Any], path: str, body: dict[str, Any], field: str
) -> None:
    resp = await client.post(path, json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == field
    assert err["message"].startswith(f"'{field}' is not supported")


async def test_null_fields_and_what_clients_always_send_are_accepted(
    client: TestClient[Any, Any],
) -> None:
    body = {
        "model": "gpt-4o",
        "user": "u-1",
        "messages": [USER],
        "max_tokens": 2,
        "reasoning_effort": None,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
    }
    assert (await client.post(CHAT, json=body)).status == 200
    body = {"prompt": "a", "n_predict": 2, "cache_prompt": True, "model": "x"}
    assert (await client.post("/completion", json=body)).status == 200
