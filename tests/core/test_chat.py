from __future__ import annotations

import pytest

from mgserve.core.chat import ChatTemplate, TemplateError, load_chat_template, normalize_messages


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


def test_chatml_is_chosen_for_qwen_and_renders_every_role() -> None:
    t = load_chat_template(None, None, "qwen3")
    assert t.name == "chatml"
    text = t.apply(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=False,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


def test_llama3_format() -> None:
    t = load_chat_template("llama3", None, "qwen3", bos_token="<|begin_of_text|>")
    text = t.apply([{"role": "user", "content": "Hi"}])
    assert text == (
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


def test_template_is_sandboxed() -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatTemplate("evil", evil).apply([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append(1) %}"
    with pytest.raises(TemplateError):
        ChatTemplate("mutate", mutate).apply([{"role": "user", "content": "x"}])


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
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text"),
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
