"""Which request fields each route implements (any other is refused, by name), and typed access.

A client that sends a field we would silently ignore (``reasoning_effort``, ``suffix``...) would
get an answer that does not do what it asked, so such a request gets a 400 naming the field
instead. A field sent as ``null`` counts as absent, as everywhere in the protocol.
Fields accepted below but only in some values (``tool_choice``, ``parallel_tool_calls``, ``echo``,
``response_format``, ``n``) are checked where they are read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mgserve.api.errors import ApiError

# sampling and stopping, read by sampling_fields.py and protocol._stop in every dialect
SAMPLING = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repeat_penalty",
        "repeat_last_n",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logit_bias",
        "stop",
        "ignore_eos",
        "stream",
        "n",
    }
)
# the one model served answers to any name; `user` is an end-user id OpenAI keeps for abuse
# monitoring, with no effect on the answer
IGNORED = frozenset({"model", "user"})
# llama-server's slot pinning, prefix-reuse switch and prompt progress (protocol._admission), on
# its /completion and the OpenAI completions routes, as llama-server takes them
ADMISSION = frozenset({"id_slot", "cache_prompt", "return_progress"})
# n-gram speculation (protocol._speculation): off for this request, llama-server's bounds on a
# step's drafts
SPECULATION = frozenset({"speculative", "speculative.n_max", "speculative.n_min"})
TEMPLATE = frozenset(
    {"messages", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt"}
)

CHAT = (
    SAMPLING
    | IGNORED
    | TEMPLATE
    | ADMISSION
    | SPECULATION
    | {
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "stream_options",
        "response_format",
        "parallel_tool_calls",
        "reasoning_format",
        # llama-server's reasoning budget (api/reasoning.py), under both of its names
        "thinking_budget_tokens",
        "reasoning_budget_tokens",
    }
)
COMPLETIONS = (
    SAMPLING
    | IGNORED
    | ADMISSION
    | SPECULATION
    | {"prompt", "max_tokens", "logprobs", "echo", "stream_options", "response_format"}
)
# llama-server's /completion
LLAMA_COMPLETION = (
    SAMPLING
    | IGNORED
    | ADMISSION
    | SPECULATION
    | {"prompt", "n_predict", "max_tokens", "n_probs", "return_tokens", "grammar", "json_schema"}
)
# llama-server's /infill: /completion's fields and the text around the cursor (api/infill.py)
INFILL = LLAMA_COMPLETION | {"input_prefix", "input_suffix", "input_extra"}
# Anthropic's /v1/messages (anthropic_inputs.py reads the template's part); `metadata`
# ({"user_id"}) is an end-user id for Anthropic's abuse tracking, with no effect on the answer
ANTHROPIC_COUNT_TOKENS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking"}
)
ANTHROPIC_MESSAGES = ANTHROPIC_COUNT_TOKENS | {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
}
# OpenAI's Responses API (responses_inputs.py reads its parts): the sampling extensions the chat
# route takes, but not n, stop or ignore_eos, which it has no place for. store and
# previous_response_id are read to refuse what needs stored responses; safety_identifier and
# prompt_cache_key are ids OpenAI keys abuse monitoring and cache routing on, with no effect on the
# answer (every prompt's cached prefix is reused here without one)
RESPONSES = (
    (SAMPLING - {"n", "stop", "ignore_eos"})
    | IGNORED
    | {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "text",
        "reasoning",
        "store",
        "previous_response_id",
        "truncation",
        "stream_options",
        "metadata",
        "safety_identifier",
        "prompt_cache_key",
    }
)
TOKENIZE = frozenset({"content", "add_special", "parse_special", "with_pieces"})
DETOKENIZE = frozenset({"tokens"})
SLOT_FILE = frozenset({"filename"})  # POST /slots/{id}?action=save | restore
APPLY_TEMPLATE = TEMPLATE | IGNORED


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(k for k, v in body.items() if k not in allowed and v is not None)
    if unknown:
        more = f" (nor {', '.join(repr(k) for k in unknown[1:])})" if unknown[1:] else ""
        raise ApiError(
            f"'{unknown[0]}' is not supported by this server{more}; "
            f"this route takes {', '.join(sorted(allowed))}",
            param=unknown[0],
        )


INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what an integer field may hold at most


def _is_int(v: Any) -> bool:
    # 5.0 is an integer too: JSON has one number type, and some clients write every number so
    return (isinstance(v, int) and not isinstance(v, bool)) or (
        isinstance(v, float) and v.is_integer()
    )


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class Fields:
    """Typed, range-checked access to a JSON object's fields; missing or null -> the default."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def get_bool(self, name: str, default: bool) -> bool:
        v = self._get(name, lambda v: isinstance(v, bool), "a boolean")
        return default if v is None else bool(v)

    def get_int(self, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        """An integer in [lo, hi], and in any case one that 64 bits hold (what the engine, torch
        and the JSON writer take: 1e30 is refused here, not in a step or an answer)."""
        v = self._get(name, _is_int, "an integer")
        if v is None:
            return default
        if not INT_MIN <= int(v) <= INT_MAX:
            raise ApiError(f"'{name}' is out of range: {int(v)} needs over 64 bits", param=name)
        return int(self._range(name, int(v), lo, hi))

    def get_float(
        self, name: str, default: float, lo: float | None = None, hi: float | None = None
    ) -> float:
        v = self._get(name, is_number, "a finite number")
        return default if v is None else float(self._range(name, v, lo, hi))

    def get_str(self, name: str, default: str) -> str:
        v = self._get(name, lambda v: isinstance(v, str), "a string")
        return default if v is None else str(v)

    def _get(self, name: str, ok: Callable[[Any], bool], kind: str) -> Any:
        """The field's value, None when missing or null; 400 naming the field if not ``ok``."""
        v = self.body.get(name)
        if v is not None and not ok(v):
            raise ApiError(f"'{name}' must be {kind}", param=name)
        return v

    @staticmethod
    def _range(name: str, v: float, lo: float | None, hi: float | None) -> float:
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            lo_s = "-inf" if lo is None else lo
            hi_s = "inf" if hi is None else hi
            raise ApiError(f"'{name}' must be in [{lo_s}, {hi_s}], got {v}", param=name)
        return v
