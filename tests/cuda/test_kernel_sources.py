"""The kernel sources as NVRTC gets them (compiler.expand_includes), checked without a GPU: every
header a kernel file includes exists, every header is used, and, where nvcc is installed, every
kernel file and every header on its own compiles to PTX for sm_90 (front end and unoptimised code
generation, default -D values), so a syntax or type error in a kernel or a shared header shows up
in CI rather than on the device; and every kernel entry keeps the programmatic-dependent-launch
contract of kernels/pdl.cuh (it reaches ``griddepcontrol.wait``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mgserve.cuda import compiler

KERNELS = sorted(p.name for p in compiler.KERNEL_DIR.glob("*.cu"))
HEADERS = sorted(p.name for p in compiler.KERNEL_DIR.glob("*.cuh"))
NVCC = shutil.which("nvcc")

_INLINED = re.compile(r"^// ---- ([A-Za-z0-9_]+\.cuh) ----$", re.MULTILINE)
_DEFINE = re.compile(r"^#define ([A-Z_][A-Z_0-9]*) ([0-9]+)\b", re.MULTILINE)
_UNROLL = re.compile(r"^#pragma unroll ([A-Z_][A-Z_0-9]*)$", re.MULTILINE)


def test_kernels_expand_and_every_header_is_used() -> None:
    used: set[str] = set()
    for name in KERNELS:
        text = compiler.expand_includes(compiler.KERNEL_DIR / name)
        assert not re.search(r"^#include", text, re.MULTILINE), f"{name}: an include is left"
        used.update(_INLINED.findall(text))
    assert used == set(HEADERS), f"headers no kernel includes: {sorted(set(HEADERS) - used)}"


def nvcc_source(name: str) -> str:
    """``name`` expanded, with each `#pragma unroll MACRO` given the macro's value: NVRTC expands
    the macro, nvcc's host preprocessor leaves it to the front end, which rejects it."""
    text = compiler.expand_includes(compiler.KERNEL_DIR / name)
    values = dict(_DEFINE.findall(text))
    return _UNROLL.sub(lambda m: f"#pragma unroll {values[m.group(1)]}", text)


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
@pytest.mark.parametrize("name", KERNELS + HEADERS)
def test_compiles_with_nvcc(name: str, tmp_path: Path) -> None:
    src = tmp_path / f"{Path(name).stem}.cu"
    text = nvcc_source(name)
    src.write_text(text)
    ptx = tmp_path / "out.ptx"
    arch = "sm_90a" if "wgmma.mma_async" in text else "sm_90"  # warpgroup MMA: sm_90a's alone
    cmd = [NVCC, "-ptx", "-Xcicc", "-O0", f"-arch={arch}", "-std=c++17", "-o", ptx, src]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{name} does not compile:\n{run.stderr[-4000:]}"
    if name.endswith(".cu"):
        missing = entries_without_grid_wait(ptx.read_text())
        assert not missing, f"{name}: kernels that never call grid_wait() (pdl.cuh): {missing}"


_FUNC = re.compile(
    r"^(?:\.(?:visible|weak|extern)\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z0-9_$]+)", re.M
)


def entries_without_grid_wait(ptx: str) -> list[str]:
    """The .entry functions of ``ptx`` from which no path of calls reaches griddepcontrol.wait."""
    heads = list(_FUNC.finditer(ptx))
    ends = [m.start() for m in heads[1:]] + [len(ptx)]
    pairs = zip(heads, ends, strict=True)
    bodies = {m.group(2): (m.group(1), ptx[m.end() : end]) for m, end in pairs}
    waits = {n for n, (_, body) in bodies.items() if "griddepcontrol.wait" in body}
    changed = True
    while changed:  # callers of a function that waits wait too
        grown = {n for n, (_, b) in bodies.items() if any(f"{w}," in b for w in waits)}
        changed = not grown <= waits
        waits |= grown
    return sorted(n for n, (kind, _) in bodies.items() if kind == "entry" and n not in waits)
