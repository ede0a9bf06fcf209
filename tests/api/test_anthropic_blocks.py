"""The chat output parser's events -> Anthropic content-block events (anthropic_blocks.py): the
exact event sequence, the content it folds into, and the same content as the anthropic client
accumulates it from the stream."""

from __future__ import annotations

from typing import Any

from anthropic.lib.streaming._messages import accumulate_event

from mgserve.api.anthropic_blocks import Blocks, content_of
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


def plain() -> ChatOutputParser:
    """A parser for a template with no reasoning or tool-call syntax: all text is content."""
    return ChatOutputParser(detect_format(""))


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


def _start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def _json(text: str) -> dict[str, Any]:
    return {"type": "input_json_delta", "partial_json": text}


def test_a_turn_of_reasoning_text_and_two_tool_calls() -> None:
    blocks = Blocks(plain())
    events = blocks.events(TURN) + blocks.finish()
    assert events == [
        _start(0, {"type": "thinking", "thinking": "", "signature": ""}),
        _delta(0, {"type": "thinking_delta", "thinking": "Need the "}),
        _delta(0, {"type": "thinking_delta", "thinking": "weather."}),
        _stop(0),
        _start(1, {"type": "text", "text": ""}),
        _delta(1, {"type": "text_delta", "text": "Checking."}),
        _stop(1),
        _start(2, {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}),
        _delta(2, _json('{"city": ')),
        _delta(2, _json('"Oslo"}')),
        _stop(2),
        _start(3, {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {}}),
        _delta(3, _json("{}")),
        _stop(3),
    ]
    assert blocks.tool_use
    assert content_of(events) == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {}},
    ]


def test_the_client_accumulates_the_same_content() -> None:
    blocks = Blocks(plain())
    events = blocks.events(TURN) + blocks.finish()
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "m",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    }
    snapshot = None
    bufs: dict[int, bytes] = {}  # the client's partial tool inputs, across events
    for ev in [start, *events]:
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    got = [b.model_dump(exclude_none=True) for b in snapshot.content]
    assert got == content_of(events)


def test_text_and_reasoning_alternate_and_a_tool_call_is_closed_by_what_follows() -> None:
    blocks = Blocks(plain())
    parsed: list[Event] = [
        ContentDelta("a"),
        ReasoningDelta("r"),
        ContentDelta("b"),
        ToolCallStart(0, "c0", "f"),
        ContentDelta("after"),  # the call never ended: the text closes its block
        ToolCallEnd(0),  # and its late end closes nothing more
    ]
    events = blocks.events(parsed) + blocks.finish()
    assert [e["type"] for e in events].count("content_block_stop") == 5
    assert content_of(events) == [
        {"type": "text", "text": "a"},
        {"type": "thinking", "thinking": "r", "signature": ""},
        {"type": "text", "text": "b"},
        {"type": "tool_use", "id": "c0", "name": "f", "input": {}},
        {"type": "text", "text": "after"},
    ]


def test_plain_text_is_one_text_block() -> None:
    blocks = Blocks(plain())
    events = blocks.feed("Hel") + blocks.feed("") + blocks.feed("lo") + blocks.finish()
    assert events == [
        _start(0, {"type": "text", "text": ""}),
        _delta(0, {"type": "text_delta", "text": "Hel"}),
        _delta(0, {"type": "text_delta", "text": "lo"}),
        _stop(0),
    ]
    assert not blocks.tool_use
    empty = Blocks(plain())
    assert empty.feed("") + empty.finish() == [] and content_of([]) == []
