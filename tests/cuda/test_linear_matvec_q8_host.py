"""The int8-activation block readers of the CUDA kernels (kernels/gguf_blocks_q8.cuh: ``load`` a
chunk, decode it to int8 words, ``dot`` it with int8 activations), compiled for the CPU with a host
C++ compiler, against gguf-py's dequantization: for each format with an int8 kernel, a block's
chunks summed equal sum_v w_v * xq_v * xd_(v / 32) within float rounding. No GPU needed, so a
wrong shift, offset or pairing of weights and activations shows up in CI, not on the device
(test_linear_matvec_host_decoders.py does the same for the fp32 readers and shares its shims).
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from mgserve.cuda import compiler
from mgserve.cuda.ops.linear_tuning import INT8_TYPES
from tests.cuda.test_linear_matvec import random_tensor
from tests.cuda.test_linear_matvec_host_decoders import CXX, SHIMS, build, host_text

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")

TYPES = sorted(INT8_TYPES)

Q8_SHIMS = r"""
static inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++)
        c += (int)(signed char)(a >> 8 * k) * (int)(signed char)(b >> 8 * k);
    return c;
}
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
"""


@functools.cache
def readers(tmp: Path) -> ctypes.CDLL:
    """The header + one ``dot_<TYPE>(blocks, n, xq, xd, out)`` per format: out[i] = block i's
    chunks' dot products summed in chunk order."""
    # mma.cuh is device-only (inline PTX); the mma tiles that call it are not called here
    header = (compiler.KERNEL_DIR / "gguf_blocks_q8.cuh").read_text(encoding="utf-8")
    mma = '#include "mma.cuh"\n'
    assert mma in header, "gguf_blocks_q8.cuh's includes changed: update this test"
    stub = tmp / "host_q8.cuh"
    no_mma = "static inline void mma_s8(int (&)[4], const u32 (&)[4], u32, u32) {}\n"
    stub.write_text(header.replace(mma, no_mma))
    text = host_text(stub)
    entries = "".join(
        f'extern "C" void dot_{t}(const u8* b, long n, const i8* xq, const float* xd, '
        f"float* out) {{\n"
        f"    for (long i = 0; i < n; i++) {{\n"
        f"        float acc = 0.f;\n"
        f"        for (int j = 0; j < {t}::CHUNKS; j++)\n"
        f"            acc += {t}::dot({t}::load(b + i * {t}::BYTES, j), j,\n"
        f"                            xq + i * {t}::BLOCK, xd + i * ({t}::BLOCK / 32));\n"
        f"        out[i] = acc;\n    }}\n}}\n"
        for t in TYPES
    )
    check = """
template <int C> static long unbias_mismatches() {  // every word of bytes in [0, 2C)
    long bad = 0;
    for (u32 w = 0; w < (u32)(2 * C) * (2 * C) * (2 * C) * (2 * C); w++) {
        u32 v = 0, want = 0, rest = w;
        for (int k = 0; k < 4; k++, rest /= 2 * C) {
            const int b = (int)(rest % (2 * C));
            v |= (u32)b << 8 * k;
            want |= (u32)(u8)(signed char)(b - C) << 8 * k;  // no byte saturates here
        }
        bad += unbias4<C>(v) != want;
    }
    return bad;
}
extern "C" long unbias_mismatches_16() { return unbias_mismatches<16>(); }
extern "C" long unbias_mismatches_32() { return unbias_mismatches<32>(); }
"""
    return build(tmp / "host_q8", SHIMS + Q8_SHIMS + text + entries + check)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    try:
        return readers(tmp_path_factory.mktemp("q8"))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"host build of the int8 readers failed:\n{e.stderr[-4000:]}")


@pytest.mark.parametrize("type_name", TYPES)
def test_int8_readers_match_gguf(lib: ctypes.CDLL, type_name: str) -> None:
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(TYPES.index(type_name))
    n = 256
    raw = np.ascontiguousarray(random_tensor(type_name, n, block, rng), dtype=np.uint8)
    xq = rng.integers(-127, 128, size=n * block, dtype=np.int8)
    xd = rng.uniform(0.001, 0.02, size=n * block // 32).astype(np.float32)
    out = np.full(n, np.nan, dtype=np.float32)
    getattr(lib, f"dot_{type_name}")(
        raw.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_long(n),
        xq.ctypes.data_as(ctypes.c_void_p),
        xd.ctypes.data_as(ctypes.c_void_p),
        out.ctypes.data_as(ctypes.c_void_p),
    )
    w = dequantize(raw, qtype).reshape(n, block).astype(np.float64)
    x = (xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 32)).reshape(n, block)
    want = (w * x).sum(axis=1)
    scale = np.abs(w * x).sum(axis=1)  # the terms' size: fp32 sums of them round within ~1e-6
    err = np.abs(out.astype(np.float64) - want) / np.maximum(scale, 1e-30)
    worst = int(err.argmax())
    assert err.max() <= 1e-5, (
        f"{type_name}: block {worst}: {out[worst]} against gguf-py's {want[worst]} "
        f"(relative to the terms {err[worst]:.2e})"
    )


def test_unbias4_is_the_saturating_subtraction_on_its_range(lib: ctypes.CDLL) -> None:
    """unbias4<C> (the readers' 2-instruction byte decode) against v - C per byte for every word
    of bytes in [0, 2C): Q5_0's C = 16 (1M words), Q6_K's C = 32 (16.8M)."""
    for c in (16, 32):
        fn = getattr(lib, f"unbias_mismatches_{c}")
        fn.restype = ctypes.c_long
        assert fn() == 0, f"unbias4<{c}> differs from a per-byte subtraction"
