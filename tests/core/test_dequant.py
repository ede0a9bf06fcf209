"""The reference path's dequantization (mgserve.core.reference.dequant) of the low-bit types that
dynamic quants use, against gguf-py's ``quants.dequantize`` and against values worked out by hand
from each block layout: hand-built single blocks, random blocks in a GGUF file written and read
back, and the refusal of types we do not read."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from mgserve.core.gguf.reader import GGUFError, GGUFFile, TensorInfo
from mgserve.core.gguf.writer import GGUFWriter
from mgserve.core.reference.dequant import SUPPORTED_TYPES, dequantize
from tests.cuda.test_linear_matvec import random_tensor

NEW_TYPES = ["Q2_K", "Q3_K", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
             "IQ1_M"]  # fmt: skip


def info(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> TensorInfo:
    qtype = GGMLQuantizationType[type_name]
    return TensorInfo("w", type_name, int(qtype), shape, int(np.prod(shape)), raw.size, 0, raw)


def ref(type_name: str, block: bytes | np.ndarray) -> np.ndarray:
    """One block through the reference path: float32 [block values]."""
    raw = np.frombuffer(bytes(block), dtype=np.uint8).copy()
    n = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    got = dequantize(None, info(type_name, raw, (n,))).numpy()  # type: ignore[arg-type]
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(-1)
    np.testing.assert_array_equal(got, want)  # the reference path is gguf-py's
    return got


def f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_every_new_type_is_supported_and_sizes_agree() -> None:
    assert set(NEW_TYPES) <= SUPPORTED_TYPES
    # the layouts below, in bytes per 256 (MXFP4: 32) values
    sizes = {"Q2_K": 84, "Q3_K": 110, "MXFP4": 17, "IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82,
             "IQ3_XXS": 98, "IQ3_S": 110, "IQ1_S": 50, "IQ1_M": 56}  # fmt: skip
    for name, size in sizes.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]][1] == size, name


def test_q2_k_by_hand() -> None:
    # scale byte i: sc = i % 15 + 1, m = 2; every q byte 0b11100100: q = (e % 128) // 32
    scales = bytes(((2 << 4) | (i % 15 + 1)) for i in range(16))
    v = ref("Q2_K", scales + bytes([0xE4]) * 64 + f16(0.5) + f16(0.25))
    e = np.arange(256)
    want = 0.5 * (e // 16 % 15 + 1) * ((e % 128) // 32) - 0.25 * 2
    np.testing.assert_array_equal(v, want)


def test_q3_k_by_hand() -> None:
    # hmask 0x55: the high bit is set for even e // 32 (offset 0), clear for odd (offset -4);
    # ql = (e % 128) // 32; every 6-bit scale 33 (low nibbles 1, high bits 2): s - 32 = 1
    block = bytes([0x55]) * 32 + bytes([0xE4]) * 64 + bytes([0x11]) * 8 + bytes([0xAA]) * 4
    v = ref("Q3_K", block + f16(2.0))
    e = np.arange(256)
    want = 2.0 * ((e % 128) // 32 - 4 * ((e // 32) % 2))
    np.testing.assert_array_equal(v, want)


def test_mxfp4_by_hand() -> None:
    # e = 129: d = 2^(129 - 128) = 2; byte i: low nibble i, high nibble 15 - i
    levels = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]  # e2m1, doubled
    v = ref("MXFP4", bytes([129]) + bytes(i | ((15 - i) << 4) for i in range(16)))
    want = [2 * levels[i] for i in range(16)] + [2 * levels[15 - i] for i in range(16)]
    np.testing.assert_array_equal(v, want)


def test_iq2_xxs_by_hand() -> None:
    # sub-block 0: grid entries 0, 1, 0, 0; sign index 1 for group 0 (ksigns[1] = 0x81: values 0
    # and 7 negative), scale 3: db = d (0.5 + 3) / 4; other sub-blocks all zero bytes
    aux = 1 | (3 << 28)
    sub0 = bytes([0, 1, 0, 0]) + aux.to_bytes(4, "little")
    v = ref("IQ2_XXS", f16(1.0) + sub0 + bytes(56))
    grid = quants.IQ2_XXS.grid.reshape(256, 8)
    db = 3.5 / 4
    assert grid[1, 0] == 43 and (grid[0] == 8).all()  # the levels 8, 25, 43
    np.testing.assert_array_equal(v[:8], db * np.array([-8, 8, 8, 8, 8, 8, 8, -8]))
    np.testing.assert_array_equal(v[8:16], db * grid[1])
    np.testing.assert_array_equal(v[32:], np.full(224, 0.5 / 4 * 8))


def test_iq1_s_by_hand() -> None:
    # sub-block 1 (values 32..63): qh = scale 2 (bits 12..14), delta negative (bit 15), high
    # index bits of group 1 = 1: group 1 reads grid entry 256 + qs[5]
    qh = [0] * 8
    qh[1] = (2 << 12) | 0x8000 | (1 << 3)
    qs = bytearray(32)
    qs[5] = 7
    block = f16(0.5) + bytes(qs) + b"".join(q.to_bytes(2, "little") for q in qh)
    v = ref("IQ1_S", block)
    grid = quants.IQ1_S.grid.reshape(2048, 8)
    np.testing.assert_array_equal(v[40:48], 0.5 * 5 * (grid[256 + 7] - 0.125))
    np.testing.assert_array_equal(v[:8], 0.5 * 1 * (grid[0] + 0.125))


def test_iq1_m_scale_is_spread_over_four_nibbles() -> None:
    # d = 1.5 (f16 0x3E00): nibbles 0x0, 0x0, 0xE, 0x3 go to the top of words 0..3; sub-block
    # scales (3 bits each) all 1: dl = d * 3; qh nibbles all 0: grid entry 0, delta +0.125
    words = [(0x0 << 12), (0x0 << 12), (0xE << 12), (0x3 << 12)]
    words = [w | (1 << 0) | (1 << 3) | (1 << 6) | (1 << 9) for w in words]
    block = bytes(32) + bytes(16) + b"".join(w.to_bytes(2, "little") for w in words)
    v = ref("IQ1_M", block)
    grid = quants.IQ1_M.grid.reshape(2048, 8)
    np.testing.assert_array_equal(v[:8], 1.5 * 3 * (grid[0] + 0.125))


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_random_blocks_through_a_file(tmp_path: Path, type_name: str) -> None:
    """A [3, 2 blocks] tensor of random valid blocks written to a GGUF file and read back."""
    qtype = GGMLQuantizationType[type_name]
    block = GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(int(qtype))
    raw = random_tensor(type_name, 3, 2 * block, rng)
    path = tmp_path / "t.gguf"
    with GGUFWriter(path, None) as w:
        w.add_tensor_info("w", (2 * block, 3), qtype)
        w.write_header()
        w.write_tensor_data("w", raw)
    g = GGUFFile(path)
    got = dequantize(g, g.tensor("w"))
    assert got.dtype == torch.float32 and tuple(got.shape) == (3, 2 * block)
    want = quants.dequantize(raw, qtype).reshape(3, 2 * block)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.numpy(), want)


def test_a_type_we_do_not_read_is_refused_by_file_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "tq.gguf"
    with GGUFWriter(path, None) as w:
        w.add_tensor_info("blk.0.ffn_down.weight", (256, 1), GGMLQuantizationType.TQ1_0)
        w.write_header()
        w.write_tensor_data("blk.0.ffn_down.weight", np.zeros(54, dtype=np.uint8))
    g = GGUFFile(path)
    with pytest.raises(
        GGUFError, match=r"tq\.gguf: tensor 'blk\.0\.ffn_down\.weight' has type TQ1_0"
    ) as e:
        dequantize(g, g.tensor("blk.0.ffn_down.weight"))
    assert "IQ1_M" in str(e.value)  # the message lists what is supported


def test_an_unknown_type_id_is_refused() -> None:
    t = TensorInfo("w", "UNKNOWN_99", 99, (256,), 256, 54, 0, np.zeros(54, dtype=np.uint8))
    with pytest.raises(GGUFError, match="has type UNKNOWN_99, which the reference path does not"):
        dequantize(SimpleNamespace(path=Path("m.gguf")), t)  # type: ignore[arg-type]
