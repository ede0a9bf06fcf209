"""Shared kernel headers are inlined by the compiler (no GPU needed): the text NVRTC compiles,
and so the cubin cache key, contains the header."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgserve.cuda import compiler


def test_kernels_inline_their_shared_headers() -> None:
    text = compiler.expand_includes(compiler.KERNEL_DIR / "matvec.cu")
    assert '#include "gguf_blocks.cuh"' not in text
    assert "struct Q4_K" in text and text.count("typedef unsigned char u8;") == 1
    for name in ("dequant.cu", "moe.cu", "matvec_q8.cu", "moe_q8.cu"):
        assert '#include "gguf' not in compiler.expand_includes(compiler.KERNEL_DIR / name)


def test_header_inlined_once_and_missing_header_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiler, "KERNEL_DIR", tmp_path)
    (tmp_path / "a.cuh").write_text("#pragma once\nint a;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "a.cuh"\nint k;\n')
    text = compiler.expand_includes(tmp_path / "k.cu")
    assert text.count("int a;") == 1 and "#pragma once" not in text and "int k;" in text
    (tmp_path / "bad.cu").write_text('#include "nope.cuh"\n')
    with pytest.raises(ValueError, match="nope.cuh"):
        compiler.expand_includes(tmp_path / "bad.cu")
