"""A broken qwen3next file gets an error that names the file and the tensor at fault."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mgserve.core.gguf.reader import GGUFError
from mgserve.core.models import load_model
from tests.core import hybrid_export

ARCH = "qwen3next"


@pytest.fixture(scope="module")
def hf() -> Any:
    return hybrid_export.hf_model(ARCH)


def _export(hf: Any, path: Path, edit: Any = None) -> Path:
    return hybrid_export.export(hf, ARCH, path, edit=edit)


def test_truncated_file_names_a_tensor(hf: Any, tmp_path: Path) -> None:
    path = _export(hf, tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"t\.gguf: tensor '[^']+' ends at byte \d+ .*truncated"):
        load_model(path)


@pytest.mark.parametrize(
    "name", ["blk.0.ssm_a", "blk.3.attn_q.weight", "blk.5.ffn_down_exps.weight"]
)
def test_missing_tensor_is_named(hf: Any, tmp_path: Path, name: str) -> None:
    path = _export(hf, tmp_path / "m.gguf", edit=lambda t: t.pop(name))
    with pytest.raises(GGUFError, match=rf"m\.gguf.*'{re.escape(name)}'.*missing"):
        load_model(path)


def test_wrong_tensor_shape_is_named(hf: Any, tmp_path: Path) -> None:
    name = "blk.3.attn_k.weight"

    def shrink(t: dict[str, np.ndarray]) -> None:
        t[name] = t[name][:-8]  # [out, in]: 8 output rows short

    path = _export(hf, tmp_path / "s.gguf", edit=shrink)
    with pytest.raises(GGUFError, match=rf"s\.gguf.*'{re.escape(name)}' has shape .*expected"):
        load_model(path)
