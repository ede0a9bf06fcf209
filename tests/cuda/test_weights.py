"""Uploading GGUF tensors in their block layout. The validation runs before any GPU work, so these
tests use device="cpu" and run everywhere (no cuda-python needed)."""

from __future__ import annotations

import numpy as np
import pytest

from mgserve.cuda.weights import FORMATS, row_bytes, upload_bytes


def test_upload_keeps_the_bytes_in_rows() -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=3 * 2 * 144, dtype=np.uint8)
    w = upload_bytes("blk.0.attn_q.weight", "Q4_K", (512, 3), raw, device="cpu")
    assert (w.k, w.rows, w.nbytes) == (512, 3, raw.size)
    assert tuple(w.data.shape) == (3, 288)
    assert np.array_equal(w.data.numpy().reshape(-1), raw)


def test_rows_of_a_3d_tensor_are_all_outer_dimensions() -> None:
    raw = np.zeros(4 * 5 * 34, dtype=np.uint8)
    w = upload_bytes("blk.0.ffn_up_exps.weight", "Q8_0", (32, 5, 4), raw, device="cpu")
    assert (w.k, w.rows) == (32, 20)


def test_unsupported_type_names_tensor_and_type() -> None:
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_down\.weight' has type TQ1_0"):
        upload_bytes("blk.3.ffn_down.weight", "TQ1_0", (256, 2), np.zeros(108, np.uint8), "cpu")


def test_misaligned_width_and_wrong_size_are_rejected() -> None:
    with pytest.raises(ValueError, match="not a positive multiple of 256"):
        row_bytes("t", "Q6_K", 640)
    with pytest.raises(ValueError, match="expected 420"):
        upload_bytes("t", "Q6_K", (256, 2), np.zeros(400, np.uint8), "cpu")


def test_formats_agree_with_gguf_py() -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, fmt in FORMATS.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert fmt.nbytes * block == size * fmt.block, name
