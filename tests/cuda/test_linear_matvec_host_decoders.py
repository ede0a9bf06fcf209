"""The block decoders of the CUDA kernels (kernels/gguf_blocks*.cuh), compiled for the CPU with a
host C++ compiler, against gguf-py's dequantization: every format in FORMATS, hand-picked and
random blocks. No GPU needed, so a wrong shift or offset shows up in CI, not on the device.

The headers are used as the kernels see them (compiler.expand_includes), with a few shims for the
CUDA-only pieces: __device__ qualifiers, the vector types, __int_as_float / __popc / __ldg /
__byte_perm, and the PTX f16 conversion. Built with -ffp-contract=off, the values should equal
gguf-py's; we allow 1e-6 of each block's max |value| (the device may fuse d * q - m into one
FMA: 2^-24 relative). The raw-bits readers of the prompt GEMMs and the HC mix
(gguf_split.cuh, each SPLIT_DECODE) are held to gguf-py bitwise: each of their products of a
block's scale and a small integer is exact in f32.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mgserve.cuda import compiler
from mgserve.cuda.weights import FORMATS
from tests.cuda.test_linear_matvec import random_tensor

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")

TYPES = sorted(FORMATS)

SHIMS = r"""
#include <cstdint>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
template <class T> static inline T __ldg(const T* p) { T v; std::memcpy(&v, p, sizeof v); return v;
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // prmt, default mode
    const unsigned long long v = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)(v >> 8 * ((s >> 4 * i) & 7) & 0xFF) << 8 * i;
    return r;
}
static inline float host_f16(unsigned short h) {  // IEEE half -> float, exactly
    const unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? __builtin_nanf("") : __builtin_inff();
    else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
"""
PTX_F16 = 'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));'


@functools.cache
def decoders(tmp: Path) -> ctypes.CDLL:
    """The headers + one `decode_<TYPE>(blocks, n_blocks, out)` entry per format, built once."""
    stub = tmp / "host_decoders.cu"
    stub.write_text(
        '#include "gguf_blocks.cuh"\n#include "gguf_blocks_lowbit.cuh"\n'
        '#include "gguf_blocks_iq.cuh"\n'
    )
    text = host_text(stub)
    entries = "".join(
        f'extern "C" void decode_{t}(const u8* b, long n, float* out) {{\n'
        f"    for (long i = 0; i < n; i++)\n"
        f"        for (int j = 0; j < {t}::BLOCK / 8; j++)\n"
        f"            {t}::load(b + i * {t}::BYTES, j, out + i * {t}::BLOCK + 8 * j);\n}}\n"
        for t in TYPES
    )
    return build(tmp / "host_decoders", SHIMS + text + entries)


def host_text(path: Path) -> str:
    """``path`` with its headers expanded and the device-only f16 conversion (inline PTX)
    replaced by the host shim."""
    text = compiler.expand_includes(path)
    assert PTX_F16 in text, "f16_bits changed: update the shim"
    return text.replace(PTX_F16, "f = host_f16(h);")


def build(stem: Path, source: str) -> ctypes.CDLL:
    """``source`` (after <cmath>) compiled by the host compiler into ``stem``.so, loaded."""
    assert CXX is not None
    src, lib = stem.with_suffix(".cpp"), stem.with_suffix(".so")
    src.write_text("#include <cmath>\n" + source)
    cmd = [CXX, "-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-w"]
    subprocess.run([*cmd, "-o", str(lib), str(src)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    try:
        return decoders(tmp_path_factory.mktemp("decoders"))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"host build of the decoders failed:\n{e.stderr[-4000:]}")


def decode(lib: ctypes.CDLL, type_name: str, raw: np.ndarray, entry: str = "decode") -> np.ndarray:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if type_name in ("F32", "F16", "BF16"):
        block = 8  # the kernels' "block" of plain types is one 8-value run
        size = FORMATS[type_name].nbytes
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.size // size
    out = np.full(n * block, np.nan, dtype=np.float32)
    fn = getattr(lib, f"{entry}_{type_name}")
    fn(
        raw.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_long(n),
        out.ctypes.data_as(ctypes.c_void_p),
    )
    return out


def oracle(type_name: str, raw: np.ndarray) -> np.ndarray:
    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return raw.view(np.float32).copy()
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    return dequantize(raw, qtype).reshape(-1).astype(np.float32)


def assert_close(type_name: str, got: np.ndarray, want: np.ndarray, block: int) -> None:
    assert np.isfinite(want).all(), f"{type_name}: the test data is not finite"
    g, w = got.reshape(-1, block).astype(np.float64), want.reshape(-1, block).astype(np.float64)
    tol = 1e-6 * np.abs(w).max(axis=1, keepdims=True)
    bad = np.argwhere(np.abs(g - w) > tol)
    assert bad.size == 0, (
        f"{type_name}: {len(bad)} values differ, first at block {bad[0][0]} value {bad[0][1]}: "
        f"{g[tuple(bad[0])]} vs gguf-py {w[tuple(bad[0])]}"
    )


@pytest.mark.parametrize("type_name", TYPES)
def test_host_decoders_match_gguf(lib: ctypes.CDLL, type_name: str) -> None:
    block = max(32, FORMATS[type_name].block)
    rng = np.random.default_rng(TYPES.index(type_name))
    raw = random_tensor(type_name, 64, block, rng)  # 64 random blocks (of 32 values for floats)
    want = oracle(type_name, raw)
    assert_close(type_name, decode(lib, type_name, raw), want, block)


SPLIT_TYPES = ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16", "BF16", "F32"]  # gguf_split.cuh's own readers


def split_readers(tmp: Path, split_decode: int) -> ctypes.CDLL:
    """gguf_split.cuh under SPLIT_DECODE ``split_decode``: one `split_<TYPE>(blocks, n, out)`
    entry per reader, each run fetched, then decoded, as the kernels do."""
    stub = tmp / f"host_split{split_decode}.cu"
    stub.write_text(f'#define SPLIT_DECODE {split_decode}\n#include "gguf_split.cuh"\n')
    entries = "".join(
        f'extern "C" void split_{t}(const u8* b, long n, float* out) {{\n'
        f"    typedef split::{t} R;\n"
        f"    for (long i = 0; i < n; i++)\n"
        f"        for (int j = 0; j < R::BLOCK / 8; j++)\n"
        f"            R::decode(R::fetch(b + i * R::BYTES, j), out + i * R::BLOCK + 8 * j);\n}}\n"
        for t in SPLIT_TYPES
    )
    return build(tmp / f"host_split{split_decode}", SHIMS + host_text(stub) + entries)


@pytest.mark.parametrize("split_decode", [1, 2])
def test_split_readers_are_gguf_bitwise(
    tmp_path_factory: pytest.TempPathFactory, split_decode: int
) -> None:
    """The prompt GEMMs' and the HC mix's raw-bits readers, by shifts and masks (1) or byte
    permutes (2, the default), against gguf-py bit for bit: random blocks, and blocks whose
    scale bytes sweep every 6-bit scale and min of Q4_K's eight sub-blocks."""
    try:
        lib = split_readers(tmp_path_factory.mktemp("split"), split_decode)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"host build of gguf_split.cuh failed:\n{e.stderr[-4000:]}")
    for type_name in SPLIT_TYPES:
        block = max(32, FORMATS[type_name].block)
        rng = np.random.default_rng(50 + SPLIT_TYPES.index(type_name))
        raw = random_tensor(type_name, 64, block, rng).reshape(64, -1)
        if type_name == "Q4_K":  # scale bytes 4..15 of each block: every value of each byte
            sweep = np.repeat(raw[:1], 256, axis=0)
            sweep[:, 4:16] = (np.arange(256)[:, None] + 17 * np.arange(12)[None, :]) % 256
            raw = np.concatenate([raw, sweep])
        raw = raw.reshape(-1)
        out, want = decode(lib, type_name, raw, "split"), oracle(type_name, raw)
        bad = np.flatnonzero(out.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (
            f"SPLIT_DECODE {split_decode} {type_name}: {bad.size} values differ, first at "
            f"{bad[0]}: {out[bad[0]]} vs gguf-py {want[bad[0]]}"
        )
