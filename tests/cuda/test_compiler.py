"""The on-disk cubin cache: a second compiler (a new process, in effect) loads from disk without
calling NVRTC, fast; a changed source or option set compiles again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_second_compile_hits_the_disk_cache(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    from mgserve.cuda.compiler import KernelCompiler

    cold = KernelCompiler(0, cache_dir=tmp_path)
    t0 = time.perf_counter()
    cold.kernel("matvec.cu", "matvec_Q4_K_t1")
    cold_s = time.perf_counter() - t0
    assert (cold.stats.compiles, cold.stats.disk_hits) == (1, 0)
    cubins = list((tmp_path / "kernels").glob("matvec-*.cubin"))
    assert len(cubins) == 1 and cubins[0].stat().st_size > 0

    warm = KernelCompiler(0, cache_dir=tmp_path)
    t0 = time.perf_counter()
    warm.kernel("matvec.cu", "matvec_Q4_K_t1")
    warm_s = time.perf_counter() - t0
    assert (warm.stats.compiles, warm.stats.disk_hits) == (0, 1)
    print(f"matvec.cu: NVRTC {cold_s * 1e3:.0f} ms, warm start {warm_s * 1e3:.1f} ms")
    assert warm_s < 0.2, f"warm start took {warm_s * 1e3:.0f} ms"

    # same compiler again: served from memory, no file read
    warm.kernel("matvec.cu", "matvec_Q8_0_t8")
    assert (warm.stats.compiles, warm.stats.disk_hits) == (0, 1)


def test_options_and_source_change_the_key(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    from mgserve.cuda.compiler import KernelCompiler

    c = KernelCompiler(0, cache_dir=tmp_path)
    opts = c.options()
    text = b'extern "C" __global__ void f() {}'
    base = c.cache_path("util.cu", text, opts)
    assert c.cache_path("util.cu", text + b" ", opts) != base
    assert c.cache_path("util.cu", text, c.options(defines=(("X", "1"),))) != base
    c.module("util.cu", c.options(defines=(("UNUSED_FLAG", "1"),)))
    c.module("util.cu")
    assert c.stats.compiles == 2


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    from mgserve.cuda.compiler import KernelCompiler

    with pytest.raises(ValueError, match="no kernel source 'nope.cu'"):
        KernelCompiler(0, cache_dir=tmp_path).module("nope.cu")
