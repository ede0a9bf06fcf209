"""``mgserve kernels build`` (cuda/prebuild.py): cubins compiled without a GPU under the names the
server's ``KernelCompiler`` looks up, kept when already there, copied from an earlier build's
folder, a failure named; on a GPU, the server's ``Kernels`` then load prebuilt modules (plain,
with defines, sm_90a) from disk without calling NVRTC. The CPU tests
need NVRTC (the ``test`` extra installs it), as test_kernels_offline.py does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mgserve.cli import main
from mgserve.cuda import offline
from mgserve.cuda.kernel_variants import Variant, variants

MISSING = offline.nvrtc_missing()
needs_nvrtc = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
# small modules: act.cu (one variant) and the router's lean variants (route.cu, -D defines)
SMALL = [v for v in variants() if v.source == "act.cu" or v.label.startswith("route.cu[lean")]


def _runtime_path(cache: Path, v: Variant, arch: str) -> Path:
    """Where ``Kernels.kernel`` (launch.py) finds ``v``'s module on an sm_<arch> GPU: the
    compiler's options for the defines, sm_90a for a wgmma module, ``KernelCompiler.cache_path``."""
    from mgserve.cuda.compiler import KERNEL_DIR, CompileOptions, KernelCompiler, expand_includes

    compiler = KernelCompiler.__new__(KernelCompiler)  # (its __init__ needs a GPU)
    compiler.cache_dir = cache
    opts = CompileOptions(arch=arch + ("a" if v.sm90a else ""), defines=v.defines)
    return compiler.cache_path(v.source, expand_includes(KERNEL_DIR / v.source).encode(), opts)


@needs_nvrtc
def test_build_writes_what_the_runtime_looks_up_and_keeps_it(tmp_path: Path) -> None:
    from mgserve.cuda import prebuild

    assert len(SMALL) >= 3
    cache = tmp_path / "kernels"
    first = prebuild.build(SMALL, ["90"], cache, jobs=2)
    assert [r.how for r in first] == ["built"] * len(SMALL)
    for v, r in zip(SMALL, first, strict=True):
        assert r.path == _runtime_path(cache, v, "90"), r.label
        assert r.path.read_bytes()[:4] == b"\x7fELF", r.label  # a cubin
    assert len({r.path for r in first}) == len(SMALL)  # each variant its own file
    stamps = [os.stat(r.path).st_mtime_ns for r in first]
    again = prebuild.build(SMALL, ["90"], cache, jobs=2)
    assert [r.how for r in again] == ["present"] * len(SMALL)
    assert [os.stat(r.path).st_mtime_ns for r in again] == stamps  # not rewritten


@needs_nvrtc
def test_wgmma_modules_are_built_for_arch_90_only(tmp_path: Path) -> None:
    from mgserve.cuda import prebuild

    wg = next(v for v in variants() if v.sm90a)
    assert prebuild.build([wg], ["86"], tmp_path) == []
    (r,) = prebuild.build([wg], ["90"], tmp_path)
    assert r.how == "built" and r.path == _runtime_path(tmp_path, wg, "90")
    assert "-sm90a-" in r.path.name


@needs_nvrtc
def test_a_failure_is_named_and_fails_the_command(tmp_path: Path, monkeypatch, capsys) -> None:
    import mgserve.cuda.kernel_variants as kv
    from mgserve.cuda import prebuild

    broken = Variant("act.cu", (("float", "(("),), "broken")  # every float a syntax error
    (r,) = prebuild.build([broken], ["90"], tmp_path)
    assert r.how == "failed" and "act.cu" in r.error and not r.path.exists()
    monkeypatch.setattr(kv, "variants", lambda: [broken, SMALL[0]])
    assert main(["kernels", "build", "--cache-dir", str(tmp_path), "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: act.cu[broken] @ sm_90" in out
    assert "1 built, 0 already there, 0 reused, 1 failed" in out


@needs_nvrtc
def test_reuse_copies_an_earlier_build_and_keeps_what_it_compiles(tmp_path: Path) -> None:
    from mgserve.cuda import prebuild

    first, second, shared = tmp_path / "a", tmp_path / "b", tmp_path / "shared"
    built = prebuild.build(SMALL, ["90"], first / "kernels", jobs=2, reuse=shared)
    assert [r.how for r in built] == ["built"] * len(SMALL)
    assert sorted(p.name for p in shared.iterdir()) == sorted(r.path.name for r in built)
    again = prebuild.build(SMALL, ["90"], second / "kernels", jobs=2, reuse=shared)
    assert [r.how for r in again] == ["reused"] * len(SMALL)
    for a, b in zip(built, again, strict=True):
        assert a.path.name == b.path.name and a.path.read_bytes() == b.path.read_bytes()
        assert b.path.stat().st_mode & 0o777 == 0o644  # readable by whatever uid serves


@needs_nvrtc
def test_the_default_folder_is_the_servers(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MGSERVE_CACHE_DIR", str(tmp_path / "served"))
    assert main(["kernels", "build", "--only", "act.cu", "--jobs", "1"]) == 0
    assert len(list((tmp_path / "served" / "kernels").glob("act-sm90-*.cubin"))) == 1
    assert "1 built, 0 already there, 0 reused, 0 failed" in capsys.readouterr().out


def test_bad_arguments_are_clear_errors(tmp_path: Path, capsys) -> None:
    for args, msg in (
        (["--arch", "sm_90"], "--arch 'sm_90': expected numbers such as 90"),
        (["--arch", ","], "--arch: no arch given"),
        (["--only", "no-such-variant"], "--only 'no-such-variant' matches no variant"),
    ):
        if MISSING is not None and "--only" in args:
            continue  # (NVRTC's absence is said first)
        assert main(["kernels", "build", "--cache-dir", str(tmp_path), *args]) == 2
        assert msg in capsys.readouterr().err


@pytest.mark.gpu
def test_a_server_compiler_loads_a_prebuilt_module(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    from mgserve.cuda import prebuild
    from mgserve.cuda.compiler import KernelCompiler
    from mgserve.cuda.launch import Kernels
    from mgserve.cuda.runtime import gpu_info

    arch = gpu_info(0).arch
    act = next(v for v in variants() if v.source == "act.cu")
    # a module with defines, and on an H100 / H200 a wgmma one (sm_90a), as the ops ask for them
    lean = next(v for v in variants() if v.label == "route.cu[lean acq_rel]")
    wg = next(v for v in variants() if v.sm90a and v.defines)
    chosen = [act, lean, *([wg] if arch == "90" else [])]
    built = prebuild.build(chosen, [arch], tmp_path / "kernels")
    assert [r.how for r in built] == ["built"] * len(chosen)
    kernels = Kernels(KernelCompiler(0, cache_dir=tmp_path))
    kernels.kernel("act.cu", "silu_mul_f32_v4")
    kernels.kernel("route.cu", "matvec_route_F32_t1", lean.defines)
    if arch == "90":
        kernels.kernel(wg.source, "qgemm_wg" if "qgemm" in wg.source else "hgemm_wg", wg.defines,
                       sm90a=True)  # fmt: skip
    stats = kernels.compiler.stats
    assert (stats.compiles, stats.disk_hits) == (0, len(chosen)), stats.log
