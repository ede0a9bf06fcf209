"""llama-server's /infill on the fake engine with real code-model tokenizers: Qwen2.5-Coder's
(FIM_REP / FIM_SEP: the repo-level pattern) and DeepSeek-Coder's (prefix, suffix, middle and a
BOS: the snippet pattern). Prompts are checked token by token against their parts."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mgserve.api.infill import SNIPPET
from mgserve.core.text.bpe import BYTE_TO_CHAR
from mgserve.core.text.tokenizer import Tokenizer
from tests.api.test_llama import engine_of, sse_events
from tests.core.coder_vocab import coder_metadata
from tests.core.test_tokenizer_llama_vectors import metadata

PREFIX = "def add(a, b):\n"
SUFFIX = "\n\nprint(add(1, 2))\n"
REPLY = "return a + b"


@cache
def coder() -> Tokenizer:
    return Tokenizer.from_metadata(coder_metadata())


def reply_ids(tok: Tokenizer, text: str) -> list[int]:
    """The fake engine's reply: ``text`` in single-byte tokens, then the vocab's EOS."""
    ids = [tok.token_id(BYTE_TO_CHAR[b]) for b in text.encode()]
    return [t for t in ids if t is not None] + [tok.eos_id or 0]


def enc(tok: Tokenizer, text: str, parse_special: bool = False) -> list[int]:
    return tok.encode(text, add_special=False, parse_special=parse_special)


@pytest.fixture
async def coder_client(make_client: Callable[..., Any]) -> TestClient[Any, Any]:
    tok = coder()
    return await make_client(  # type: ignore[no-any-return]
        tokenizer=tok, n_ctx=512, batch_size=128, reply=reply_ids(tok, REPLY)
    )


async def test_repo_level_prompt_token_by_token(coder_client: TestClient[Any, Any]) -> None:
    tok = coder()
    fim = tok.fim
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "prompt": "    ",
        "input_extra": [{"filename": "util.py", "text": "X = 1\n", "time": 12.5}, {"text": "Y"}],
        "n_predict": 16,
        "temperature": 0,
    }
    resp = await coder_client.post("/infill", json=body)
    assert resp.status == 200, await resp.text()
    r = await resp.json()
    want = [
        fim.rep, *enc(tok, "myproject\n"),
        fim.sep, *enc(tok, "util.py\n"), *enc(tok, "X = 1\n"),
        fim.sep, *enc(tok, "tmp\n"), *enc(tok, "Y"),
        fim.sep, *enc(tok, "filename\n"),
        fim.pre, *enc(tok, PREFIX), *enc(tok, "    ", parse_special=True),
        fim.suf, *enc(tok, SUFFIX),
        fim.mid,
    ]  # fmt: skip
    assert engine_of(coder_client).submitted[-1].prompt == want
    assert r["prompt"] == (
        "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>tmp\nY"
        "<|file_sep|>filename\n<|fim_prefix|>" + PREFIX + "    <|fim_suffix|>" + SUFFIX
        + "<|fim_middle|>"
    )  # fmt: skip
    assert r["content"] == REPLY and r["stop"] is True and r["tokens_evaluated"] == len(want)


async def test_special_text_is_code_in_prefix_and_parsed_in_prompt(
    coder_client: TestClient[Any, Any],
) -> None:
    tok = coder()
    body = {"input_prefix": "s = '<|fim_middle|>'", "input_suffix": "", "prompt": "<|im_end|>"}
    assert (await coder_client.post("/infill", json=body)).status == 200
    prompt = engine_of(coder_client).submitted[-1].prompt
    head = [tok.fim.rep, *enc(tok, "myproject\n"), tok.fim.sep, *enc(tok, "filename\n")]
    assert prompt == [
        *head,
        tok.fim.pre,
        *enc(tok, "s = '<|fim_middle|>'"),
        tok.token_id("<|im_end|>"),
        tok.fim.suf,
        tok.fim.mid,
    ]
    assert prompt.count(tok.fim.mid) == 1


async def test_prefix_suffix_and_extra_are_cut_to_the_budget(
    coder_client: TestClient[Any, Any],
) -> None:
    """-b 128: the prefix keeps its last 96 tokens, the suffix its first 32 - 2 - len(prompt);
    the extra context its last n_ctx - 2 n_predict - (the FIM part, a batch at least) tokens.
    Here the FIM part is 129: with its 3 FIM tokens it passes the batch by one."""
    tok = coder()
    prefix = "".join(f"x{i} = {i}\n" for i in range(60))
    suffix = "".join(f"y{i} = {i}\n" for i in range(60))
    files = [{"filename": f"f{k}.py", "text": "".join(f"z{k}{i}\n" for i in range(60))}
             for k in range(3)]  # fmt: skip
    body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": "x60", "n_predict": 20}
    body["input_extra"] = files
    assert (await coder_client.post("/infill", json=body)).status == 200
    got = engine_of(coder_client).submitted[-1].prompt
    p, s, prompt = enc(tok, prefix), enc(tok, suffix), enc(tok, "x60", parse_special=True)
    assert len(p) > 96 and len(s) > 32
    extra = [tok.fim.rep, *enc(tok, "myproject\n")]
    for f in files:
        extra += [tok.fim.sep, *enc(tok, f["filename"] + "\n"), *enc(tok, f["text"])]
    extra += [tok.fim.sep, *enc(tok, "filename\n")]
    middle = [tok.fim.pre, *p[-96:], *prompt, tok.fim.suf, *s[: 32 - 2 - len(prompt)], tok.fim.mid]
    assert len(middle) == 129
    n_extra = 512 - 2 * 20 - 129
    assert len(extra) > n_extra
    assert got == extra[-n_extra:] + middle


async def test_unbounded_answer_leaves_one_token(make_client: Callable[..., Any]) -> None:
    tok = coder()
    client = await make_client(tokenizer=tok, n_ctx=256, batch_size=64)
    text = "".join(f"w{i}\n" for i in range(300))
    body = {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": text}]}
    assert (await client.post("/infill", json=body)).status == 200
    got = engine_of(client).submitted[-1].prompt
    assert len(got) == 255 - 64 + 5  # the extra fills the room less a batch; the FIM part is 5
    assert got[-5:] == [tok.fim.pre, *enc(tok, "a"), tok.fim.suf, *enc(tok, "b"), tok.fim.mid]


async def test_mixed_ids_and_text_in_prefix(coder_client: TestClient[Any, Any]) -> None:
    tok = coder()
    body = {"input_prefix": [tok.fim.pad, "def"], "input_suffix": [" x", 42]}
    assert (await coder_client.post("/infill", json=body)).status == 200
    got = engine_of(coder_client).submitted[-1].prompt
    want = [tok.fim.pre, tok.fim.pad, *enc(tok, "def"), tok.fim.suf, *enc(tok, " x"), 42]
    assert got[-len(want) - 1 :] == [*want, tok.fim.mid]


async def test_snippet_pattern_and_bos_without_repo_tokens(
    make_client: Callable[..., Any],
) -> None:
    tok = Tokenizer.from_metadata(metadata("deepseek-coder"))
    assert tok.fim.sep is None and tok.add_bos
    client = await make_client(tokenizer=tok, n_ctx=512, batch_size=128)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"text": "X = 1"}]}
    assert (await client.post("/infill", json=body)).status == 200
    want = [
        *enc(tok, SNIPPET), *enc(tok, "X = 1"),
        tok.bos_id, tok.fim.pre, *enc(tok, PREFIX), tok.fim.suf, *enc(tok, SUFFIX), tok.fim.mid,
    ]  # fmt: skip
    assert engine_of(client).submitted[-1].prompt == want


async def test_stream(coder_client: TestClient[Any, Any]) -> None:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True, "n_probs": 1}
    resp = await coder_client.post("/infill", json=body)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    assert "".join(e["content"] for e in events) == REPLY
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert events[-1]["stop_type"] == "eos"


async def test_model_without_fim_tokens_is_refused(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert resp.status == 400
    msg = (await resp.json())["error"]["message"]
    assert msg == (
        "infill is not supported by this model: its vocabulary has no fill-in-the-middle "
        "prefix, suffix, middle tokens"
    )


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input_suffix": ""}, "input_prefix", "'input_prefix' is required"),
        ({"input_prefix": ""}, "input_suffix", "'input_suffix' is required"),
        ({"input_prefix": 1, "input_suffix": ""}, "input_prefix", "must be a string or a list"),
        ({"input_prefix": "", "input_suffix": "", "prompt": [1]}, "prompt", "must be a string"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, "input_extra", "a list"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": [{}]}, "input_extra", ".text"),
        (
            {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "lang": "c"}]},
            "input_extra",
            "'lang' is not supported",
        ),
        (
            {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 3}]},
            "input_extra",
            "input_extra[0].filename must be a string",
        ),
        ({"input_prefix": ["a", -1], "input_suffix": ""}, "input_prefix", "outside the vocab"),
        ({"input_prefix": "", "input_suffix": "", "n_indent": 4}, "n_indent", "not supported"),
    ],
)
async def test_bad_requests(
    coder_client: TestClient[Any, Any], body: dict[str, Any], param: str, says: str
) -> None:
    resp = await coder_client.post("/infill", json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == param and says in err["message"], err
