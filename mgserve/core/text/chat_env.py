"""The jinja2 environment chat templates run in: a sandbox with what real templates use.

A GGUF's ``tokenizer.chat_template`` is untrusted code. It runs in jinja2's sandbox (no attribute
starting with ``_``, no function objects' internals, ``range`` capped, ``str.format`` checked), with
the globals and filters Hugging Face templates expect (transformers' set: ``raise_exception``,
``strftime_now``, a ``tojson`` with its options, ``namespace``) plus what llama.cpp's engine also
gives them (``from_json``, the ``{% generation %}`` tag). Unlike transformers' immutable sandbox,
lists and dicts may be changed in place (``.append``, ``.pop``, ``.update``: Kimi's templates keep a
queue of tool-call ids that way); the template only ever sees fresh plain copies of the request's
JSON, so what it changes is its own. What the sandbox cannot stop by itself, output size, is bounded
here: repetition (``'x' * n``), powers, padding and JSON indents are capped.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import SandboxedEnvironment

from mgserve.core.text import chat_limits as limits

MAX_REPEAT = 1 << 20  # longest string or list that `*` may build in a template
MAX_POW_BITS = 4096  # largest integer `**` may build
MAX_WIDTH = 1 << 16  # largest width for str padding methods and json indents
_PADDING = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


class TemplateError(ValueError):
    """The template rejected the conversation (its own raise_exception) or failed to render."""


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | list[str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: non-ASCII kept (jinja's own tojson escapes it and HTML characters),
    # with json.dumps' options, which templates use to match the model's training data
    if isinstance(indent, int) and indent > MAX_WIDTH:
        raise SecurityError(f"tojson indent {indent} is larger than {MAX_WIDTH}")
    limits.check_size(limits.text_bound(value), "a JSON text")
    if separators is not None:
        separators = (str(separators[0]), str(separators[1]))
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )


def _json_default(value: Any) -> Any:
    # jinja's map/select filters return generators, which templates pipe into tojson
    # (`tools | map(attribute='function') | tojson`); llama.cpp's engine gives lists there
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def from_json(text: str) -> Any:
    # llama.cpp's engine has it (DeepSeek V3.2/V4 parse string tool arguments with it)
    return json.loads(text)


class Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names (as transformers' does): a template has no
    business storing what looks like an internal attribute."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if not isinstance(name, str) or name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not be named {name!r}")


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it (to
    build a training mask); for serving the block renders as its body, as in llama.cpp."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _repeat(a: Any, b: Any) -> Any:
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
            raise SecurityError(f"a template may not build a sequence longer than {MAX_REPEAT}")
    return operator.mul(a, b)


def _power(a: Any, b: Any) -> Any:
    if (
        isinstance(a, int)
        and isinstance(b, int)
        and abs(a) > 1
        and b * abs(a).bit_length() > (MAX_POW_BITS)
    ):
        raise SecurityError(f"a template may not build an integer over {MAX_POW_BITS} bits")
    return operator.pow(a, b)


def _bounded_width(f: Callable[..., str], name: str) -> Callable[..., str]:
    def bounded(value: Any, *args: Any, **kwargs: Any) -> str:
        width = args[0] if args else kwargs.get("width")
        if isinstance(width, int) and width > MAX_WIDTH:
            raise SecurityError(f"the {name} filter's width {width} is larger than {MAX_WIDTH}")
        return f(value, *args, **kwargs)

    return bounded


_BINOPS: dict[str, Callable[[Any, Any], Any]] = {"*": _repeat, "**": _power, "+": limits.add}


class ChatSandbox(SandboxedEnvironment):
    """jinja2's sandbox with mutable lists and dicts, bounded output-building operators, and the
    render budget of chat_limits.py (time and text) on every loop, call and output."""

    intercepted_binops = frozenset(_BINOPS)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        return limits.guard_tree(super()._parse(source, name, filename))

    def call(
        __self,  # noqa: N805 -- jinja's signature: a call's kwargs may be named self, context, obj
        __context: jinja2.runtime.Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        limits.check_call(__obj, args)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        if operator in _BINOPS:
            return _BINOPS[operator](left, right)
        return super().call_binop(context, operator, left, right)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, str) and attr in _PADDING:
            return False  # "x".ljust(10**12): no template needs padding by method
        return super().is_safe_attribute(obj, attr, value)


class NoLoader(jinja2.BaseLoader):
    """``{% include %}``, ``{% import %}``, ``{% from %}`` and ``{% extends %}`` name files: a chat
    template is one self-contained text and reads none (``/etc/passwd`` neither)."""

    def get_source(self, environment: jinja2.Environment, template: str) -> Any:
        raise SecurityError(
            f"a chat template may not include, import or extend another template ({template!r})"
        )


def chat_environment() -> ChatSandbox:
    """A fresh environment, set as transformers sets it (trim_blocks, lstrip_blocks, loops)."""
    env = ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationTag],
        loader=NoLoader(),
    )
    env.filters["tojson"] = tojson
    env.filters["from_json"] = from_json
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    env.globals.pop("lipsum", None)  # text generation no template needs
    env.filters[limits.LOOP_FILTER] = limits.loop_guard
    env.filters[limits.TEXT_FILTER] = limits.text_guard
    env.filters[limits.OUT_FILTER] = limits.out_guard
    env.filters["join"] = limits.bounded_join(env.filters["join"])
    env.filters["replace"] = limits.bounded_replace(env.filters["replace"])
    env.filters["center"] = _bounded_width(env.filters["center"], "center")
    env.filters["indent"] = _bounded_width(env.filters["indent"], "indent")
    return env
