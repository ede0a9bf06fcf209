"""Hypothesis strategies for the fuzz tests (test_fuzz.py): per route, JSON bodies built from the
fields the route takes (fields.py) with values of every JSON type, extreme numbers and near-valid
shapes, beside fields it does not take, and raw bytes."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from mgserve.api import fields

# the JSON a field may hold: extreme and edge numbers beside ordinary ones
NUMBERS = st.one_of(
    st.integers(-5, 300),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, 1e308, -1e308, 5e-324, 1.0, 2.0]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), NUMBERS, st.text(max_size=20), st.sampled_from(["", "a", "\x00"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
ROLES = st.sampled_from(["user", "assistant", "system", "tool", "developer", "wizard", ""])
CONTENT_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "tool_use", "x"])}),
    JSON,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": ROLES,
            "content": st.one_of(st.text(max_size=30), st.lists(CONTENT_PART, max_size=3)),
        }
    ),
    JSON,
)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), JSON)
PROMPT = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(-3, 300), max_size=10),
    st.lists(st.one_of(st.text(max_size=8), st.integers(0, 300)), max_size=3),
    JSON,
)
# fields whose values are worth shaping (a plain JSON value rarely reaches the code behind them)
SHAPED: dict[str, st.SearchStrategy[Any]] = {
    "messages": MESSAGES,
    "prompt": PROMPT,
    "content": st.one_of(st.text(max_size=40), JSON),
    "tokens": st.one_of(st.lists(st.integers(-3, 300), max_size=10), JSON),
    "input": st.one_of(st.text(max_size=30), st.lists(MESSAGE, max_size=3), JSON),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), JSON),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(-3, 300).map(str), NUMBERS, max_size=5),
        st.lists(
            st.lists(st.one_of(st.integers(-3, 300), st.text(max_size=5), NUMBERS)), max_size=4
        ),
        JSON,
    ),
    "max_tokens": st.one_of(st.integers(-2, 300), NUMBERS, JSON),
    "n_predict": st.one_of(st.integers(-2, 300), NUMBERS, JSON),
    "stream": st.one_of(st.booleans(), JSON),
}
# what each route takes, and a body that passes its checks (so fuzzed fields reach deep)
ROUTES: dict[str, tuple[frozenset[str], dict[str, Any]]] = {
    "/v1/chat/completions": (fields.CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    "/v1/completions": (fields.COMPLETIONS, {"prompt": "hi"}),
    "/completion": (fields.LLAMA_COMPLETION, {"prompt": "hi"}),
    "/infill": (fields.INFILL, {"input_prefix": "a", "input_suffix": "b"}),
    "/tokenize": (fields.TOKENIZE, {"content": "hi"}),
    "/detokenize": (fields.DETOKENIZE, {"tokens": [104, 105]}),
    "/apply-template": (fields.APPLY_TEMPLATE, {"messages": [{"role": "user", "content": "hi"}]}),
    "/v1/messages": (
        fields.ANTHROPIC_MESSAGES,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    ),
    "/v1/messages/count_tokens": (
        fields.ANTHROPIC_COUNT_TOKENS,
        {"messages": [{"role": "user", "content": "hi"}]},
    ),
    "/v1/responses": (fields.RESPONSES, {"input": "hi"}),
    # save and restore need a model whose cache can be written (test_slot_routes.py has them)
    "/slots/0?action=erase": (frozenset(), {}),
}
GET_ROUTES = [
    "/health", "/v1/health", "/props", "/slots", "/metrics", "/v1/models", "/models",
    "/openapi.json",
]  # fmt: skip


def value_for(name: str) -> st.SearchStrategy[Any]:
    return SHAPED.get(name, JSON)


@st.composite
def body_for(draw: st.DrawFn, route: str) -> Any:
    """A body for ``route``: its valid base with some fields fuzzed, a few unknown ones, or any
    JSON at all."""
    allowed, base = ROUTES[route]
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(JSON)
    body = dict(base) if kind < 8 else {}
    names = sorted(allowed)
    # mostly one or two fields: more at once, and one of them is nearly always refused first
    n = draw(st.sampled_from([1, 1, 1, 2, 2, 5]))
    for name in draw(st.lists(st.sampled_from(names), max_size=n, unique=True)) if names else []:
        body[name] = draw(value_for(name))
    if kind == 9:
        body[draw(st.text(max_size=10))] = draw(JSON)
    if body.get("stream") is True and route in ("/completion", "/v1/completions"):
        body.setdefault("n_predict" if route == "/completion" else "max_tokens", 4)
    return body
