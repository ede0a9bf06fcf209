"""The grammars of forced tool calls (mgserve/api/tool_grammar.py), compiled and walked token by
token: each format's grammar accepts what the family's own template writes for a call (with its
markers as text and as special tokens), and refuses a wrong function name, a schema-violating
argument, text around the calls, a second call when one is asked for, and a reasoning block where
the prompt closed it."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest

from mgserve.api.chat_output import ChatFormat, detect_format
from mgserve.api.errors import ApiError
from mgserve.api.tool_grammar import forced_calls, mistral_layout, think_state
from mgserve.core.grammar import GrammarCompiler, GrammarSpec
from mgserve.core.grammar.vocab import is_special
from mgserve.core.synth.vocab import SynthVocab
from mgserve.core.text.tokenizer import Tokenizer
from tests.api.fakes import FakeTokenizer
from tests.api.test_chat_output import CASES, TOOLS, rendered_turn, template

MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]"]
MARKERS += ["[CALL_ID]"]
XML = ChatFormat("xml", ("<think>", "</think>"))
HERMES = ChatFormat("hermes", ("<think>", "</think>"))
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


@cache
def special_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary whose tool-call and reasoning markers are special tokens
    (user-defined, as in Qwen's files; control, as in Mistral's)."""
    vocab = SynthVocab(320, "qwen2", endoftext_id=317, im_start_id=318, im_end_id=319)
    meta = {k: v for k, (v, _) in vocab.metadata().items()}
    meta["tokenizer.ggml.tokens"] = tokens = list(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.token_type"] = types = list(meta["tokenizer.ggml.token_type"])
    for i, m in enumerate(MARKERS):
        tokens[300 + i], types[300 + i] = m, 3 if m.startswith("[") else 4
    return Tokenizer.from_metadata(meta)


@cache
def compiler(special: bool) -> GrammarCompiler:
    tok: Any = special_tokenizer() if special else FakeTokenizer()
    return GrammarCompiler(tok, tok.n_vocab)


def build(fmt: ChatFormat, tools: Any = TOOLS, special: bool = False, **kw: Any) -> str:
    tok: Any = compiler(special).tokenizer

    def special_id(marker: str) -> int | None:
        tid = tok.token_id(marker)
        return tid if tid is not None and is_special(tok, tid) else None

    kw = {"parallel": True, "think": "none"} | kw
    return forced_calls(fmt, tools, special=special_id, **kw)


def accepts(lark: str, text: str, special: bool = False) -> bool:
    """Whether the grammar allows ``text``'s tokens, one by one, and then ends there."""
    comp = compiler(special)
    m = comp.compile(GrammarSpec("lark", lark)).matcher()
    for t in comp.tokenizer.encode(text, add_special=False, parse_special=special):
        if t not in m.allowed().tolist():
            return False
        m.advance(t)
    return m.done or any(t in m.allowed().tolist() for t in comp.tokenizer.eog_ids)


@pytest.mark.parametrize(("name", "bos", "eos", "fmt", "n"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("special", [False, True], ids=["text", "special"])
def test_accepts_what_the_template_writes(
    name: str, bos: str, eos: str, fmt: str, n: int, special: bool
) -> None:
    tmpl = template(name, bos, eos)
    chat_format = detect_format(tmpl.source)
    prompt, out = rendered_turn(tmpl, n)
    layout = mistral_layout(tmpl.source)
    think = think_state(chat_format, prompt)
    lark = build(chat_format, special=special, think=think, mistral=layout)
    assert accepts(lark, out, special), (lark, out)
    if n == 2:  # one call only, when parallel calls are off
        single = build(chat_format, special=special, think=think, mistral=layout, parallel=False)
        assert not accepts(single, out, special)


WRONG = [
    CALL.replace("get_weather", "get_weathers"),  # no such function
    CALL.replace("3", "three"),  # days is an integer
    CALL.replace("Paris", "Paris</parameter>"),  # the value ends at its first closing tag
    CALL.replace("<parameter=city>\nParis\n</parameter>\n", ""),  # city is required
    CALL.replace("</function>", "<parameter=hour>\n3\n</parameter>\n</function>"),  # unknown
    "I will call it.\n" + CALL,  # no text around the calls
    CALL + "\nDone.",
    "<think>\nhm\n</think>\n\n" + CALL,  # the prompt closed the reasoning block
]


@pytest.mark.parametrize("special", [False, True], ids=["text", "special"])
def test_refuses_what_breaks_the_call(special: bool) -> None:
    lark = build(XML, special=special)
    assert accepts(lark, CALL, special)
    assert accepts(lark, CALL + "\n" + CALL.replace("Paris", "Rome"), special)
    for text in WRONG:
        assert not accepts(lark, text, special), text
    named = build(XML, [TOOLS[1]], special=special)  # only "search" may be called
    assert not accepts(named, CALL, special)
    assert accepts(named, "<tool_call>\n<function=search>\n</function>\n</tool_call>", special)


def test_json_formats_refuse_schema_violations() -> None:
    lark = build(HERMES)
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {}}}\n</tool_call>'
    assert accepts(lark, call.format('{"city": "Paris", "days": 3}'))
    unlisted = '{"city": "Paris", "hour": 3}'  # the schema does not allow it, nor forbid it
    for args in ('{"city": "Paris", "days": "3"}', '{"days": 3}', '{"city": 5}', unlisted):
        assert not accepts(lark, call.format(args)), args
    assert not accepts(lark, call.replace("get_weather", "get_weather2").format("{}"))
    llama3 = build(ChatFormat("llama3", None))
    assert accepts(llama3, '{"name": "search", "parameters": {"query": "x"}}')
    assert not accepts(llama3, '{"name": "search", "parameters": {"query": 1}}')


def test_reasoning_where_the_template_opens_it() -> None:
    opened = build(XML, think="open")  # the prompt ended with "<think>\n"
    assert accepts(opened, "Paris, then.\n</think>\n\n" + CALL)
    assert not accepts(opened, CALL)
    free = build(HERMES, think="free")  # the model may open a block of its own
    call = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    assert accepts(free, call) and accepts(free, "<think>\nSearch.\n</think>\n\n" + call)
    assert not accepts(free, "<think>\nSearch.\n" + call)
    assert think_state(XML, "<|im_start|>assistant\n<think>\n") == "open"
    assert think_state(XML, "assistant\n<think>\n\n</think>\n\n") == "none"
    assert think_state(XML, "<|im_start|>assistant\n") == "free"


def test_xml_string_values_follow_their_schema() -> None:
    tools = copy.deepcopy(TOOLS[:1])
    props = tools[0]["function"]["parameters"]["properties"]
    props["city"] |= {"enum": ["Paris", "Rome"]}
    props["unit"] = {"type": "string", "minLength": 1, "maxLength": 3}
    lark = build(XML, tools)
    unit = CALL.replace("</function>", "<parameter=unit>\n{}\n</parameter>\n</function>")
    assert accepts(lark, unit.format("C"))
    for bad in ("", "Kelvin"):
        assert not accepts(lark, unit.format(bad)), bad
    assert not accepts(lark, CALL.replace("Paris", "Oslo"))
    props["unit"]["pattern"] = "^[CF]$"
    with pytest.raises(ApiError, match="'pattern'") as e:
        build(XML, tools)
    assert e.value.param == "tools"
