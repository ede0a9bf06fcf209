"""Generated text -> the Responses API's output items and the stream events that build them.

Every piece of generated text goes through ``Items.feed`` (and ``Items.finish`` at the end): the
chat output parser splits it into reasoning, content and tool-call events, and those become
output items, each announced by ``response.output_item.added`` and closed by
``response.output_item.done``:

- reasoning: a ``reasoning`` item with one ``reasoning_text`` part (``response.content_part.added``,
  ``response.reasoning_text.delta`` ..., ``response.reasoning_text.done``,
  ``response.content_part.done``);
- content: a ``message`` item with one ``output_text`` part (the same, with
  ``response.output_text.delta`` / ``.done``);
- a tool call: a ``function_call`` item (``response.function_call_arguments.delta`` ...,
  ``.done``).

Reasoning and content each open an item of their kind when the open item is of another kind; a
tool call opens an item that its end closes; nothing opens an item for empty text. The items are
built as the events go out (``output``), so a whole response and a streamed one say the same.
Events come without ``sequence_number``; the route numbers them as it sends them.
"""

from __future__ import annotations

import copy
import uuid
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

# an item type -> (its id prefix, its text part's type, the event family of that part's text)
_TEXT_ITEMS = {
    "message": ("msg_", "output_text", "response.output_text"),
    "reasoning": ("rs_", "reasoning_text", "response.reasoning_text"),
}


def _item(kind: str) -> dict[str, Any]:
    prefix, part_type, _ = _TEXT_ITEMS[kind]
    item: dict[str, Any] = {"id": prefix + uuid.uuid4().hex, "type": kind}
    if kind == "message":
        item["role"] = "assistant"
    else:
        item["summary"] = []  # a summary is never made (responses_inputs.py refuses one)
    part: dict[str, Any] = {"type": part_type, "text": ""}
    if kind == "message":
        part |= {"annotations": [], "logprobs": []}
    return item | {"status": "in_progress", "content": [part]}


class Items:
    """One response's output items, and the events that build them, from its text as it is
    generated."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.output: list[dict[str, Any]] = []  # the items so far, in output order
        self.open: int | None = None  # the output index of the item being written
        self.calls: dict[int, int] = {}  # tool call index -> its item's output index
        self.reasoning_tokens = 0  # tokens of the reasoning block, its markers included

    def feed(self, text: str, n_tokens: int) -> list[dict[str, Any]]:
        """The events of ``text``, the detokenized text of ``n_tokens`` generated tokens."""
        inside = self.parser.in_reasoning
        out = self.events(self.parser.feed(text))
        if inside or self.parser.in_reasoning:  # the tokens that open, fill and close it
            self.reasoning_tokens += n_tokens
        return out

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The last events; the item left open ends with ``status`` (``incomplete`` when the
        response was cut short), the others are ``completed``."""
        return self.events(self.parser.finish()) + self._close(status)

    def events(self, parsed: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in parsed:
            if isinstance(ev, ContentDelta) and ev.text:
                out += self._text("message", ev.text)
            elif isinstance(ev, ReasoningDelta) and ev.text:
                out += self._text("reasoning", ev.text)
            elif isinstance(ev, ToolCallStart):
                item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call"}
                item |= {"status": "in_progress", "call_id": ev.id, "name": ev.name}
                out += self._open(item | {"arguments": ""})
                self.calls[ev.index] = len(self.output) - 1
            elif isinstance(ev, ToolCallArgsDelta) and ev.text:
                k = self.calls[ev.index]
                self.output[k]["arguments"] += ev.text
                delta = {"type": "response.function_call_arguments.delta", "delta": ev.text}
                out.append(delta | self._where(k))
            elif isinstance(ev, ToolCallEnd) and self.open == self.calls[ev.index]:
                out += self._close("completed")
        return out

    def _where(self, k: int) -> dict[str, Any]:
        return {"item_id": self.output[k]["id"], "output_index": k}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = []
        if self.open is None or self.output[self.open]["type"] != kind:
            out = self._open(_item(kind))
        assert self.open is not None
        self.output[self.open]["content"][0]["text"] += text
        delta = {"type": _TEXT_ITEMS[kind][2] + ".delta", "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return [*out, delta | self._where(self.open)]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close("completed")
        self.open = len(self.output)
        self.output.append(item)
        added = {"type": "response.output_item.added", "output_index": self.open}
        out.append(added | {"item": item | {"content": []} if "content" in item else dict(item)})
        if "content" in item:
            part = {"type": "response.content_part.added", "content_index": 0}
            out.append(part | self._where(self.open) | {"part": dict(item["content"][0])})
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        k, self.open = self.open, None
        item = self.output[k]
        item["status"] = status
        where: dict[str, Any] = self._where(k)
        if item["type"] == "function_call":
            done = {"type": "response.function_call_arguments.done", "arguments": item["arguments"]}
            out = [done | where]
        else:
            part = item["content"][0]
            done = {"type": _TEXT_ITEMS[item["type"]][2] + ".done", "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = []
            part_done = {"type": "response.content_part.done", "part": dict(part)}
            out = [done | where | {"content_index": 0}, part_done | where | {"content_index": 0}]
        item_done = {"type": "response.output_item.done", "output_index": k}
        return [*out, item_done | {"item": copy.deepcopy(item)}]
