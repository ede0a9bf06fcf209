from __future__ import annotations

import pytest

from mgserve.core.text.chat import (
    ChatTemplate,
    TemplateError,
    load_chat_template,
    normalize_messages,
)


def gemma() -> ChatTemplate:
    return load_chat_template(None, None, "gemma3", bos_token="<bos>", eos_token="<eos>")


def test_gemma_folds_system_into_first_user_turn_and_names_assistant_model() -> None:
    text = gemma().apply(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Again"}]},
        ]
    )
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nAgain<end_of_turn>\n"
        "<start_of_turn>model\n"
    )  # the leading <bos> is dropped: the tokenizer adds it


def test_gemma_refuses_two_user_turns_in_a_row() -> None:
    with pytest.raises(TemplateError, match="alternate"):
        gemma().apply([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_builtin_format_follows_the_architecture_and_the_vocabulary() -> None:
    assert load_chat_template(None, None, "qwen3").name == "qwen3"
    assert load_chat_template(None, None, "qwen2").name == "qwen2.5"
    assert load_chat_template(None, None, "qwen4exp").name == "qwen3.5"
    assert load_chat_template(None, None, "llama").name == "llama3"
    assert load_chat_template(None, None, "mamba").name == "chatml"
    # a `llama` file whose vocabulary has ChatML markers and no Llama 3 headers (SmolLM, say)
    chatml_vocab = {"<|im_start|>", "<|im_end|>"}.__contains__
    assert load_chat_template(None, None, "llama", has_token=chatml_vocab).name == "chatml"
    gemma_vocab = {"<start_of_turn>"}.__contains__
    assert load_chat_template(None, None, "qwen3", has_token=gemma_vocab).name == "gemma"


def test_chatml_renders_every_role() -> None:
    t = load_chat_template("chatml", None, "gemma3")
    text = t.apply(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=False,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


def test_llama3_format() -> None:
    t = load_chat_template("llama3", None, "qwen3", bos_token="<|begin_of_text|>")
    text = t.apply([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_gguf_template_wins_and_runs_with_hf_globals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = (
        "{% for m in messages %}{{ m['role'] }}={{ m['content'] | tojson }};{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    t = load_chat_template(None, src, "gemma3", eos_token="</s>")
    assert t.name == "gguf"
    assert t.apply([{"role": "user", "content": "é"}]) == 'user="é";</s>'
    f = tmp_path / "t.jinja"
    f.write_text("{{ raise_exception('nope') }}")
    with pytest.raises(TemplateError, match="nope"):
        load_chat_template(str(f), src, "gemma3").apply([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "evil",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ ''.__class__ }}",
        "{{ range(10**9) | length }}",
        "{{ 'x' * 10**9 }}",
        "{{ [1] * 10**9 }}",
        "{{ 10 ** 100000 }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 'x' | center(10**9) }}",
        "{{ messages | tojson(indent=10**9) }}",
        "{{ cycler.__init__ }}",
        "{% for m in messages %}{{ m.items.__self__ }}{% endfor %}",
    ],
)
def test_template_is_sandboxed(evil: str) -> None:
    # jinja's sandbox either raises or makes an unsafe attribute undefined (rendered as nothing)
    try:
        out = ChatTemplate("evil", evil).apply([{"role": "user", "content": "x"}])
    except TemplateError as e:
        assert "Error" in str(e) or "unsafe" in str(e) or "larger" in str(e)
        return
    assert out == ""


def test_templates_may_change_their_own_lists_and_dicts_only() -> None:
    src = (
        "{% set q = namespace(ids=[]) %}"
        "{% for m in messages %}{% set _ = q.ids.append(m.role) %}{% endfor %}"
        "{% set first = q.ids.pop(0) %}{% set _ = q.ids.extend(['x']) %}"
        "{% set d = {'a': 1} %}{% set _ = d.update({'b': 2}) %}"
        "{% set _ = messages.append({'role': 'injected'}) %}{% set _ = messages[0].update(x=1) %}"
        "{{ first }} {{ q.ids | join(',') }} {{ d | tojson(sort_keys=true) }}"
    )
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert ChatTemplate("mutate", src).apply(msgs) == 'system user,x {"a": 1, "b": 2}'
    assert msgs == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def test_template_runtime_errors_become_value_errors() -> None:
    with pytest.raises(TemplateError, match="chat template error"):
        ChatTemplate("bad", "{{ messages[0]['content'] + 1 }}").apply(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ValueError, match="syntax"):
        ChatTemplate("broken", "{% for %}")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ("hi", "non-empty"),
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            r"messages\[0\]\.content\[0\]: content part type 'image_url' is not supported",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "file"}]}],
            "content part type 'file'",
        ),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "'input_audio' is not supported",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "string 'text'"),
        (
            [{"role": "assistant", "content": "", "tool_calls": {"id": 1}}],
            r"tool_calls must be a list",
        ),
        ([{"role": "user", "content": 5}], "string or a list"),
        (["hi"], "must be an object"),
    ],
)
def test_bad_messages(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_messages(messages)


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(ValueError, match="neither a built-in"):
        load_chat_template("/no/such/file.jinja", None, "gemma3")
