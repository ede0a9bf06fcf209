"""Which request fields each route implements; any other field is refused, by name.

A client that sends a field we would silently ignore (``reasoning_effort``, ``suffix``,
``grammar``...) would get an answer that does not do what it asked, so such a request gets a 400
naming the field instead. A field sent as ``null`` counts as absent, as everywhere in the protocol.
Fields accepted below but only in some values (``tool_choice``, ``parallel_tool_calls``, ``echo``,
``response_format``, ``n``) are checked where they are read.
"""

from __future__ import annotations

from typing import Any

from mgserve.api.errors import ApiError

# sampling and stopping, read by protocol.sampling_from / _stop in both dialects
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
TEMPLATE = frozenset(
    {"messages", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt"}
)

CHAT = (
    SAMPLING
    | IGNORED
    | TEMPLATE
    | {
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "stream_options",
        "response_format",
        "parallel_tool_calls",
    }
)
COMPLETIONS = SAMPLING | IGNORED | {"prompt", "max_tokens", "logprobs", "echo", "stream_options"}
# llama-server's /completion; cache_prompt is what mgserve always does (a prompt's cached prefix is
# reused, with the same results as without)
LLAMA_COMPLETION = (
    SAMPLING | IGNORED | {"prompt", "n_predict", "max_tokens", "n_probs", "return_tokens"}
) | {"cache_prompt"}
TOKENIZE = frozenset({"content", "add_special", "parse_special", "with_pieces"})
DETOKENIZE = frozenset({"tokens"})
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
