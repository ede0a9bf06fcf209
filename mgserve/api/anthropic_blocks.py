"""Generated text -> Anthropic content blocks: the stream's block events and the message's content.

Every piece of generated text goes through ``Blocks.feed`` (and ``Blocks.finish`` at the end): the
chat output parser splits it into reasoning, content and tool-call events, and those become
Anthropic's ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``) / ``content_block_stop`` events. A streamed response sends them as they come;
a whole one folds the same events into its content (``content_of``), so both say the same.

Block rules: content and reasoning each open a block of their kind when the open block is of
another kind (text <-> thinking alternate as the model does); a tool call opens a ``tool_use`` block
(its input streamed as JSON pieces) that its end closes; nothing opens a block for empty text.
"""

from __future__ import annotations

import json
from typing import Any

from mgserve.api.chat_output import (
    ChatOutputParser,
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)


class Blocks:
    """One response's content blocks, as events, built from its text as it is generated."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.n = 0  # blocks opened so far: the next block's index
        self.open: int | None = None  # the index of the block open now
        self.open_kind = ""  # its type: "text", "thinking" or "tool_use"
        self.tool_blocks: dict[int, int] = {}  # tool call index -> its block's index

    @property
    def tool_use(self) -> bool:
        """Whether the model called a tool (the turn then stops for ``tool_use``)."""
        return bool(self.tool_blocks)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self.events(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self.events(self.parser.finish()) + self._close()

    def events(self, parsed: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in parsed:
            if isinstance(ev, ContentDelta) and ev.text:
                out += self._delta("text", {"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ReasoningDelta) and ev.text:
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, ToolCallStart):
                block = {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}
                out += self._start(block)
                self.tool_blocks[ev.index] = self.n - 1
            elif isinstance(ev, ToolCallArgsDelta) and ev.text:
                delta = {"type": "input_json_delta", "partial_json": ev.text}
                out.append(_block_delta(self.tool_blocks[ev.index], delta))
            elif isinstance(ev, ToolCallEnd) and self.open == self.tool_blocks[ev.index]:
                out += self._close()
        return out

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if self.open is None or self.open_kind != kind:
            empty = {"text": ""} if kind == "text" else {"thinking": "", "signature": ""}
            out = self._start({"type": kind} | empty)
        assert self.open is not None
        return [*out, _block_delta(self.open, delta)]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.open, self.open_kind = self.n, block["type"]
        self.n += 1
        return [*out, {"type": "content_block_start", "index": self.open, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [{"type": "content_block_stop", "index": index}]


def _block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def content_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a list of block events builds (what a client accumulates from them)."""
    blocks: list[dict[str, Any]] = []
    args: dict[int, str] = {}  # a tool_use block's index -> its input's JSON so far
    for ev in events:
        if ev["type"] == "content_block_start":
            blocks.append(dict(ev["content_block"]))
            continue
        if ev["type"] != "content_block_delta":
            continue
        block, delta = blocks[ev["index"]], ev["delta"]
        if delta["type"] == "text_delta":
            block["text"] += delta["text"]
        elif delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        else:
            args[ev["index"]] = args.get(ev["index"], "") + delta["partial_json"]
    for index, text in args.items():  # the parser lets only a JSON object through as arguments
        blocks[index]["input"] = json.loads(text)
    return blocks
