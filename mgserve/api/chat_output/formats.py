"""Which tool-call syntax and reasoning markers a chat template implies, found in its source.

As llama.cpp does (common/chat.cpp), the format is recognised by what the template writes:

- ``xml``: Qwen3-Coder / Qwen3.5 (``<tool_call>`` + ``<function=`` + ``<parameter=``), also used by
  Nemotron Nano 3 and StepFun 3.5: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>``, each value typed by the tool's JSON schema;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list (Nemo) or ``NAME[CALL_ID]ID[ARGS]{...}``
  (Small 3.2, Devstral, Ministral);
- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen 2.5, Qwen 3,
  QwQ, Hermes 2/3);
- ``llama3``: a bare ``{"name": ..., "parameters": ...}`` answer, or one after ``<|python_tag|>``
  (Llama 3.1-3.3);
- ``none``: templates that write no tool calls (Gemma 2 and 3: their templates have no tool
  syntax at all, so a request with ``tools`` is refused rather than the tools dropped).

Reasoning is ``<think>...</think>`` where the template mentions ``<think>``, ``[THINK]...[/THINK]``
where it mentions ``[THINK]`` (Magistral / Ministral reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOOL_FORMATS = ("xml", "mistral", "hermes", "llama3", "none")


@dataclass(frozen=True)
class ChatFormat:
    tools: str  # one of TOOL_FORMATS
    think: tuple[str, str] | None  # the reasoning block's open and close markers, if any

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the parser reads: the detokenizer must keep these even when they are
        special (control) tokens, which it otherwise drops."""
        calls = {
            "xml": ("<tool_call>", "</tool_call>"),
            "hermes": ("<tool_call>", "</tool_call>"),
            "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
            "llama3": ("<|python_tag|>",),
            "none": (),
        }[self.tools]
        return calls + (self.think or ())


def detect_format(source: str) -> ChatFormat:
    """The format of a template, from its Jinja source."""
    if "<tool_call>" in source and "<function=" in source and "<parameter=" in source:
        tools = "xml"
    elif "[TOOL_CALLS]" in source:
        tools = "mistral"
    elif "<tool_call>" in source:
        tools = "hermes"
    elif "<|start_header_id|>" in source and '"parameters"' in source:
        tools = "llama3"
    else:
        tools = "none"
    think: tuple[str, str] | None = None
    if "<think>" in source:
        think = ("<think>", "</think>")
    elif "[THINK]" in source:
        think = ("[THINK]", "[/THINK]")
    return ChatFormat(tools, think)


def tool_schemas(tools: list[Any] | None) -> dict[str, dict[str, Any]]:
    """name -> the function's ``parameters.properties`` (an empty dict when it gives none)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (``type``, a list of them, or anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if t else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types |= schema_types(sub)
    if "enum" in schema and not types:
        types = {"string"} if all(isinstance(v, str) for v in schema["enum"]) else set()
    return types
