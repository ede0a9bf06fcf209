"""Bounds on what a chat template's rendering may cost: time, and the text it builds.

jinja2's sandbox stops a template reaching Python internals; it does not stop one that never
ends (``{% for i in range(99999) %}{% for j in range(99999) %}...``, a macro calling itself twice
per level) or one that builds text without end (``{% set ns.s = ns.s ~ ns.s %}`` in a loop). Small
requests are rendered on the event loop (api/textwork.py), so such a template would stall every
client. Rendering here therefore runs under a ``RenderBudget`` (per thread):

- every loop iteration and every call a template makes counts a step; every ``CHECK_EVERY``
  steps the clock is read, and past ``RENDER_SECONDS`` the render fails (only loops and calls can
  make a render take longer than its template is long);
- the text it builds is bounded by ``MAX_TEXT`` characters: all it outputs, counted piece by piece
  wherever it lands (the prompt, a macro's or a ``{% set %}`` block's buffer), and each ``~``
  concatenation, ``+`` of strings or lists, and ``join`` / ``replace`` (filter or method) before it
  is built.

``guard_tree`` rewrites a parsed template so that its loops, outputs and concatenations go through
the budget; chat_env.ChatSandbox applies it to every template it compiles.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jinja2.nodes as nodes
from jinja2.exceptions import SecurityError
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 10.0  # longest a render may run
MAX_TEXT = 1 << 26  # longest text (characters) or list a render may build
CHECK_EVERY = 1024  # steps between two reads of the clock
LOOP_FILTER = "mgserve_loop"  # the names guard_tree's rewritten nodes call
TEXT_FILTER = "mgserve_text"
OUT_FILTER = "mgserve_out"


class RenderBudget(threading.local):
    deadline = float("inf")
    seconds = RENDER_SECONDS
    steps = 0
    emitted = 0  # characters output so far

    def step(self) -> None:
        self.steps += 1
        if self.steps % CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise SecurityError(f"the chat template ran longer than {self.seconds:g} s")


BUDGET = RenderBudget()


@contextmanager
def render_budget(seconds: float | None = None) -> Iterator[None]:
    """A render's budget on this thread, from now (RENDER_SECONDS by default)."""
    saved = BUDGET.deadline
    BUDGET.seconds = RENDER_SECONDS if seconds is None else seconds
    BUDGET.deadline, BUDGET.steps, BUDGET.emitted = time.monotonic() + BUDGET.seconds, 0, 0
    try:
        yield
    finally:
        BUDGET.deadline = saved


def check_size(n: int, what: str) -> None:
    if n > MAX_TEXT:
        raise SecurityError(f"a chat template may not build {what} longer than {MAX_TEXT}")


def loop_guard(value: Any) -> Iterator[Any]:
    """What ``{% for %}`` iterates: the same items, one budget step each."""
    for item in value:
        BUDGET.step()
        yield item


def text_bound(value: Any, memo: dict[int, int] | None = None) -> int:
    """At least how long ``str(value)`` is, without building it: a container's items are walked
    once each however often they are referenced (``[[0] * 10**6] * 1000`` is 1000 references to
    one list, whose text would be 3 GB)."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list | tuple | dict):
        return 1
    memo = {} if memo is None else memo
    if id(value) not in memo:
        memo[id(value)] = 0  # a cycle counts once
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        memo[id(value)] = 2 * len(items) + sum(
            text_bound(x, memo) for x in items if memo.get(id(x), -1) != 0
        )
        check_size(memo[id(value)], "a text")
    return memo[id(value)]


def out_guard(value: Any) -> Any:
    """What ``{{ ... }}`` and template text output: counted against MAX_TEXT (a container by
    what its text will be, before it is made)."""
    BUDGET.emitted += text_bound(value)
    check_size(BUDGET.emitted, "output")
    return value


def text_guard(value: Any) -> Any:
    """A ``~`` operand or result: at most MAX_TEXT characters of text."""
    check_size(text_bound(value), "a text")
    return value


def add(a: Any, b: Any) -> Any:
    """``+``, refusing strings or lists longer than MAX_TEXT before building them."""
    if isinstance(a, str | list | tuple) and isinstance(b, str | list | tuple):
        check_size(len(a) + len(b), "a sequence")
    return a + b


def join_size(sep: str, items: Any) -> None:
    if isinstance(items, list | tuple):
        n = len(sep) * max(len(items) - 1, 0)
        memo: dict[int, int] = {}  # items shared by reference are walked once
        sized = (str, list, tuple, dict)
        n += sum(text_bound(x, memo) if isinstance(x, sized) else 8 for x in items)
        check_size(n, "a joined text")


def replace_size(s: str, old: str, new: str, count: int = -1) -> None:
    hits = s.count(old) if old else len(s) + 1
    if count >= 0:
        hits = min(hits, count)
    check_size(len(s) + hits * (len(new) - len(old)), "a replaced text")


def check_call(obj: Any, args: tuple[Any, ...]) -> None:
    """Before a template calls ``obj``: a budget step, and str.join / str.replace's sizes."""
    BUDGET.step()
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(owner, str):
        if name == "join" and args:
            join_size(owner, args[0])
        elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
            count = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
            replace_size(owner, str(args[0]), args[1], count)


def bounded_join(f: Any) -> Any:
    def join(ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
        if attribute is None and isinstance(value, list | tuple):
            join_size(str(d), value)
        return text_guard(f(ctx, value, d, attribute))

    join.jinja_pass_arg = getattr(f, "jinja_pass_arg", None)  # type: ignore[attr-defined]
    return join


def bounded_replace(f: Any) -> Any:
    def replace(ev: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        if isinstance(s, str) and isinstance(new, str):
            replace_size(s, str(old), new, count if isinstance(count, int) else -1)
        return f(ev, s, old, new, count)

    replace.jinja_pass_arg = getattr(f, "jinja_pass_arg", None)  # type: ignore[attr-defined]
    return replace


def _filtered(node: nodes.Node, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)  # node: an Expr


class _Guard(NodeTransformer):
    def visit_For(self, node: nodes.For) -> nodes.Node:  # noqa: N802 -- jinja's visitor names
        self.generic_visit(node)
        node.iter = _filtered(node.iter, LOOP_FILTER)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:  # noqa: N802
        self.generic_visit(node)
        node.nodes = [_filtered(n, OUT_FILTER) for n in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:  # noqa: N802
        self.generic_visit(node)
        node.nodes = [_filtered(n, TEXT_FILTER) for n in node.nodes]  # before str() of each
        return _filtered(node, TEXT_FILTER)


def guard_tree(tree: nodes.Template) -> nodes.Template:
    """``tree`` with every loop's iterable, output and ``~`` through the budget's filters."""
    _Guard().visit(tree)
    return tree
