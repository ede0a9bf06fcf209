"""The chat output parser's events -> the Responses API's output items and stream events
(responses_output.py): the event sequence, the items it builds, and the same items as the openai
client's stream accumulator builds them from the events."""

from __future__ import annotations

from typing import Any

from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from mgserve.api.chat_output import (
    ChatOutputParser,
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    detect_format,
)
from mgserve.api.responses_output import Items

TURN: list[Event] = [
    ReasoningDelta("Need the "),
    ReasoningDelta("weather."),
    ContentDelta(""),  # empty pieces open nothing
    ContentDelta("Checking."),
    ToolCallStart(0, "call_a", "get_weather"),
    ToolCallArgsDelta(0, '{"city": '),
    ToolCallArgsDelta(0, '"Oslo"}'),
    ToolCallEnd(0),
    ToolCallStart(1, "call_b", "get_time"),
    ToolCallArgsDelta(1, "{}"),
    ToolCallEnd(1),
]


def items() -> Items:
    """Items over a parser for a template with no reasoning or tool-call syntax."""
    return Items(ChatOutputParser(detect_format("")))


def without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in o.items() if k != "id"} for o in output]


def test_a_turn_of_reasoning_text_and_two_tool_calls() -> None:
    it = items()
    events = it.events(TURN) + it.finish("completed")
    text_events = ["added", "part", "delta", "done", "part_done", "item_done"]
    reasoning = ["added", "part", "delta", "delta", "done", "part_done", "item_done"]
    call = ["added", "args", "args", "args_done", "item_done"]
    short = {
        "response.output_item.added": "added",
        "response.content_part.added": "part",
        "response.reasoning_text.delta": "delta",
        "response.output_text.delta": "delta",
        "response.reasoning_text.done": "done",
        "response.output_text.done": "done",
        "response.content_part.done": "part_done",
        "response.output_item.done": "item_done",
        "response.function_call_arguments.delta": "args",
        "response.function_call_arguments.done": "args_done",
    }
    second_call = call[:2] + call[3:]  # its arguments come in one piece
    assert [short[e["type"]] for e in events] == reasoning + text_events + call + second_call
    assert [e["output_index"] for e in events if e["type"].endswith("item.added")] == [0, 1, 2, 3]
    assert without_ids(it.output) == [
        {
            "type": "reasoning",
            "summary": [],
            "status": "completed",
            "content": [{"type": "reasoning_text", "text": "Need the weather."}],
        },
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}
            ],
        },
        {
            "type": "function_call",
            "status": "completed",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {
            "type": "function_call",
            "status": "completed",
            "call_id": "call_b",
            "name": "get_time",
            "arguments": "{}",
        },
    ]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["item_id"], e["arguments"]) for e in done] == [
        (it.output[2]["id"], '{"city": "Oslo"}'),
        (it.output[3]["id"], "{}"),
    ]


def test_the_client_accumulates_the_same_output() -> None:
    it = items()
    events = it.events(TURN) + it.finish("completed")
    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m"}
    head |= {"parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    created = {"type": "response.created", "response": head | {"output": []}}
    completed = {"type": "response.completed", "response": head | {"output": it.output}}
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for i, ev in enumerate([created, *events, completed]):
        raw = construct_type(type_=ResponseStreamEvent, value=ev | {"sequence_number": i})
        state.handle_event(raw)  # type: ignore[arg-type]
    final = state._completed_response
    assert final is not None
    assert [o.model_dump(exclude_none=True) for o in final.output] == it.output
    assert final.output_text == "Checking."


def test_alternation_and_a_call_closed_by_the_text_after_it() -> None:
    it = items()
    parsed: list[Event] = [
        ContentDelta("a"),
        ReasoningDelta("r"),
        ContentDelta("b"),
        ToolCallStart(0, "c0", "f"),
        ContentDelta("after"),  # the call never ended: the text closes its item
        ToolCallEnd(0),  # and its late end closes nothing more
    ]
    events = it.events(parsed) + it.finish("incomplete")
    assert [e["type"] for e in events].count("response.output_item.done") == 5
    assert [(o["type"], o["status"]) for o in it.output] == [
        ("message", "completed"),
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "incomplete"),  # the item open when the response was cut short
    ]
    assert it.output[4]["content"][0]["text"] == "after"


def test_plain_text_is_one_message_and_no_text_is_no_item() -> None:
    it = items()
    events = it.feed("Hel", 2) + it.feed("", 1) + it.feed("lo", 1) + it.finish("completed")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["Hel", "lo"] and len(it.output) == 1 and it.reasoning_tokens == 0
    empty = items()
    assert empty.feed("", 1) + empty.finish("completed") == [] and empty.output == []


def test_reasoning_tokens_are_those_of_the_reasoning_block() -> None:
    it = Items(ChatOutputParser(detect_format("<think>")))
    for piece in ["<think>", "Hm", "m.", "</think>", "\n\n", "Yes", "."]:
        it.feed(piece, 1)
    it.finish("completed")
    assert [o["type"] for o in it.output] == ["reasoning", "message"]
    assert it.reasoning_tokens == 4  # the markers and the two tokens between them
