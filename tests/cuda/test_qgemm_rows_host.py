"""The prompt GEMMs' half row-step readers (kernels/qgemm_rows.cuh, ``QWgmmaTuning.rows``)
compiled for the CPU with a host C++ compiler, as test_linear_matvec_host_decoders.py builds the
block decoders: every step of random rows written into tiles in the 128-byte swizzle, read back
and held bit for bit to gguf-py's values rounded to f16 (what the runs' reader writes: its
values are gguf-py's bitwise, test_split_readers_are_gguf_bitwise). Row lengths with a partial
last step and rows 2 bytes off 4-byte alignment (Q5_0, Q8_0: an odd number of blocks a row);
rows read as invalid give zeros. No GPU needed."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mgserve.cuda.weights import FORMATS
from tests.cuda.test_linear_matvec import random_tensor
from tests.cuda.test_linear_matvec_host_decoders import CXX, SHIMS, build, host_text, oracle

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")

ROW_TYPES = {  # (the readers of ROW_FORMATS and ROW_FORMATS_UNTRIED: their row lengths)
    "Q4_K": (256, 768),
    "Q5_0": (96, 544, 640),
    "Q5_1": (96, 544, 640),
    "Q5_K": (256, 768),
    "Q6_K": (256, 768),
    "Q8_0": (96, 544, 640),
}
PTX_F16X2 = 'asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));'
HOST_SHIMS = r"""
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31));
}
static inline unsigned short host_f16_rn(float f) {  // float -> IEEE half, nearest even
    unsigned u;
    std::memcpy(&u, &f, 4);
    const unsigned s = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return (unsigned short)(s | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0));
    if (a >= 0x477FF000u) return (unsigned short)(s | 0x7C00u);  // rounds past 65504
    if (a < 0x38800000u) {  // a subnormal half (or zero): a multiple of 2^-24
        const float m = std::ldexp(std::fabs(f), 24);
        return (unsigned short)(s | (unsigned)std::nearbyint(m));  // (nearest even by default)
    }
    const unsigned e = (a >> 23) - 112, mant = a & 0x7FFFFFu;
    unsigned h = (e << 10) | (mant >> 13);
    const unsigned rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (unsigned short)(s | h);
}
"""


def rows_lib(tmp: Path) -> ctypes.CDLL:
    """qgemm_rows.cuh with one `rows_<TYPE>(w, n_rows, k, tiles)` entry a reader: every step of
    every row (rows r % 5 == 4 read as invalid) stored into that step's tile."""
    stub = tmp / "host_rows.cu"
    stub.write_text('#include "qgemm_rows.cuh"\n')
    text = host_text(stub)
    assert PTX_F16X2 in text, "f16x2_rn changed: update the shim"
    text = text.replace(PTX_F16X2, "r = host_f16_rn(lo) | (unsigned)host_f16_rn(hi) << 16;")
    entries = "".join(
        f'extern "C" void rows_{t}(const u8* w, long n_rows, int k, unsigned char* tiles) {{\n'
        f"    typedef RowSteps<SplitFormat<{t}>::T> RS;\n"
        f'    static_assert(RS::ON, "{t} has a reader");\n'
        f"    const size_t row_bytes = (size_t)(k / {t}::BLOCK) * {t}::BYTES;\n"
        f"    for (int s = 0; s < (k + 63) / 64; s++)\n"
        f"        for (long r = 0; r < n_rows; r++)\n"
        f"            for (int h = 0; h < 2; h++)\n"
        f"                RS::store(tiles + (size_t)s * n_rows * 128, (int)r, h,\n"
        f"                          RS::load(w + r * row_bytes, 64 * s, k, h, r % 5 != 4));\n}}\n"
        for t in ROW_TYPES
    )
    return build(tmp / "host_rows", SHIMS + HOST_SHIMS + text + entries)


def unswizzle(tiles: np.ndarray, n_rows: int, k: int) -> np.ndarray:
    """The steps' tiles (128 bytes a row, chunk c of row r at (c ^ r % 8) x 16) as [n_rows, k]
    f16 bits."""
    steps = (k + 63) // 64
    t = tiles.view(np.uint16).reshape(steps, n_rows, 8, 8)  # [step, row, stored chunk, value]
    out = np.empty((n_rows, steps * 64), dtype=np.uint16)
    for c in range(8):
        stored = c ^ (np.arange(n_rows) % 8)
        out.reshape(n_rows, steps, 8, 8)[:, :, c, :] = t[:, np.arange(n_rows), stored, :].transpose(
            1, 0, 2
        )
    return out


@pytest.mark.parametrize("type_name", sorted(ROW_TYPES))
def test_row_readers_write_the_runs_values(
    tmp_path_factory: pytest.TempPathFactory, type_name: str
) -> None:
    try:
        lib = rows_lib(tmp_path_factory.mktemp("rows"))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"host build of qgemm_rows.cuh failed:\n{e.stderr[-4000:]}")
    rng = np.random.default_rng(70 + sorted(ROW_TYPES).index(type_name))
    block = FORMATS[type_name].block
    for k in ROW_TYPES[type_name]:
        n_rows = 13
        raw = random_tensor(type_name, n_rows, k, rng).reshape(n_rows, -1)
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        steps = (k + 63) // 64
        tiles = np.full(steps * n_rows * 128, 0xAB, dtype=np.uint8)  # every byte written
        getattr(lib, f"rows_{type_name}")(
            raw.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(n_rows), ctypes.c_int(k),
            tiles.ctypes.data_as(ctypes.c_void_p),
        )  # fmt: skip
        got = unswizzle(tiles, n_rows, k)
        want = np.zeros((n_rows, steps * 64), dtype=np.uint16)
        for r in range(n_rows):
            if r % 5 != 4:
                want[r, :k] = oracle(type_name, raw[r]).astype(np.float16).view(np.uint16)
        bad = np.argwhere(got != want)
        assert bad.size == 0, (
            f"{type_name} k={k} (block {block}): {len(bad)} values differ, first at row "
            f"{bad[0][0]} k {bad[0][1]}: {got[tuple(bad[0])]:#06x} vs {want[tuple(bad[0])]:#06x}"
        )
