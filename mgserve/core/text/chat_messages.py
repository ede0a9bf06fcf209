"""OpenAI-style chat messages -> the plain data chat templates are written for.

What clients send and what templates expect differ in a few known ways, smoothed here before any
template sees the conversation (as llama.cpp's common/chat.cpp and transformers do):

- ``developer`` (sent by current OpenAI clients) takes the place of ``system``, as OpenAI defines
  it.
- A content list of text parts is joined into one string (with newlines, as llama.cpp joins them);
  any other part (``image_url``, ``input_audio``, ``file``...) is refused, naming its type: this
  server reads text only.
- A tool call's ``function.arguments`` arrives as a JSON *string*; templates iterate it as a
  mapping, so it is parsed to an object (a string that is not a JSON object is left as it is).
  A template written for strings (functionary v3.2 concatenates them) keeps them: chat.py finds
  out which kind a template is once, as llama.cpp's capability probe does.
- An assistant message with tool calls and no content gets ``""``, which templates can concatenate.

Everything comes out as fresh plain JSON values (dict, list, str, int, float, bool, None), so a
template that changes what it is given changes only its own copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system"}  # OpenAI: developer messages replace system messages


def plain(value: Any, where: str) -> Any:
    """A deep copy of JSON data; ValueError naming ``where`` for anything that is not JSON."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: object keys must be strings, got {k!r}")
            out[k] = plain(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{where}: {type(value).__name__} is not a JSON value")


def _objects(
    value: Any, where: str, not_list: str, item: str = "an object"
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The items of the list ``value`` with their indices; ValueError ``not_list`` when it is no
    list, or naming the first item that is not a JSON object (``item`` says what it must be)."""
    if not isinstance(value, list):
        raise ValueError(not_list)
    for i, obj in enumerate(value):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}[{i}] must be {item}")
        yield i, obj


def content_text(content: Any, where: str) -> str:
    """A message's content as one string: None -> "", text parts joined, anything else refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    not_list = f"{where} must be a string or a list of content parts"
    for i, part in _objects(content, where, not_list, "a content part object"):
        kind = part.get("type")
        if kind != "text":
            raise ValueError(
                f"{where}[{i}]: content part type {kind!r} is not supported; "
                "this server takes text parts only"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{i}]: a text part needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


def _arguments(args: Any) -> Any:
    if not isinstance(args, str):
        return args
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python goes
        return args  # not JSON: the template gets what the client sent
    return parsed if isinstance(parsed, dict) else args


def _tool_calls(calls: Any, where: str, parse: bool) -> list[Any]:
    out = []
    for i, call in _objects(calls, where, f"{where} must be a list"):
        fn = call.get("function")
        if fn is not None:
            if not isinstance(fn, dict):
                raise ValueError(f"{where}[{i}].function must be an object")
            if parse and "arguments" in fn:
                call = call | {"function": fn | {"arguments": _arguments(fn["arguments"])}}
        out.append(plain(call, f"{where}[{i}]"))
    return out


def normalize_messages(messages: Any, object_arguments: bool = True) -> list[dict[str, Any]]:
    """Checked, plain copies of ``messages`` as templates expect them; ValueError says what is
    wrong and where (``messages[2].content[0]: ...``). ``object_arguments=False`` keeps tool-call
    arguments as the client sent them, for the rare template written for JSON strings."""
    empty = "'messages' must be a non-empty list"
    if not messages:
        raise ValueError(empty)
    out = []
    for i, m in _objects(messages, "messages", empty):
        where = f"messages[{i}]"
        role = ALIASES.get(m.get("role"), m.get("role"))  # type: ignore[arg-type]
        if role not in ROLES:
            raise ValueError(
                f"{where}.role must be one of {', '.join(ROLES + tuple(ALIASES))}, "
                f"got {m.get('role')!r}"
            )
        msg = {k: plain(v, f"{where}.{k}") for k, v in m.items() if k != "tool_calls"}
        msg["role"] = role
        msg["content"] = content_text(m.get("content"), f"{where}.content")
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(
                m["tool_calls"], f"{where}.tool_calls", object_arguments
            )
        out.append(msg)
    return out


def normalize_tools(tools: Any) -> list[Any] | None:
    """``tools`` as the template gets it: None when absent or empty (the template then sees it
    undefined), else plain copies of the objects."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("'tools' must be a list of objects")
    return plain(tools, "tools") or None  # type: ignore[no-any-return]
