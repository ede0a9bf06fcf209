"""``mgserve kernels check``: every kernel variant compiled for a GPU arch without a GPU.

NVRTC needs no GPU and no driver, so this compiles each (source, -D defines) of
kernel_variants.py (what ``cuda_backend`` can request: formats, tilings, head dims, conv widths;
what it leaves out is said there) for ``sm_<arch>`` (default 90: H100 / H200) from the same text
(``compiler.expand_includes``) and with the same options as ``KernelCompiler._compile`` (cuda.core's
``Program`` passes ``-arch=sm_XX``, one ``--define-macro`` per define, ``--std=c++17``), plus
``--ptxas-options=-v``, whose log gives per kernel its registers, spill stores / loads and static
shared memory. A syntax error or a new register spill then shows up in CI, not on the GPU.

It calls ``cuda.bindings.nvrtc`` directly (cuda-bindings + nvidia-cuda-nvrtc, the ``kernels``
extra; imported lazily, so the CPU-only package never needs them), not cuda.core: nothing here
touches a device. NVRTC releases the GIL, so variants compile on a thread pool. A failure's log
names the expanded source's lines by their file (``matvec.cu(N) [gguf_blocks.cuh:M]``).
Not covered: linking and loading the cubin, launch-time limits (dynamic shared memory opt-in,
registers x threads), and anything only a run on the GPU shows.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from mgserve.cuda.compiler import KERNEL_DIR, CompileOptions, expand_includes
from mgserve.machine import available_cpus

if TYPE_CHECKING:  # kernel_variants imports every op module: only when compiling
    from mgserve.cuda.kernel_variants import Variant

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_MARK = re.compile(r"^// ---- (end of )?([A-Za-z0-9_]+\.cuh) ----$")


@dataclass
class KernelUsage:
    name: str
    registers: int = 0
    stack: int = 0  # stack frame bytes
    spill_stores: int = 0  # bytes
    spill_loads: int = 0
    smem: int = 0  # static shared memory bytes (dynamic shared memory is set at launch)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass
class Compiled:
    label: str
    source: str
    defines: list[list[str]]
    ok: bool
    seconds: float
    log: str  # NVRTC's log: ptxas -v lines on success, the errors (with file names) on failure
    kernels: list[KernelUsage] = field(default_factory=list)


def nvrtc_missing() -> str | None:
    """Why NVRTC cannot run here (cuda-bindings or libnvrtc missing), or None when it can."""
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
    except Exception as e:  # ImportError, or the binding failing to load libnvrtc
        return f"NVRTC unavailable ({type(e).__name__}: {e}); pip install -e '.[kernels]'"
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return f"nvrtcVersion failed: {err}"
    return None


def nvrtc_options(opts: CompileOptions) -> list[str]:
    """The options ``KernelCompiler._compile``'s ``ProgramOptions`` hands NVRTC, in its order."""
    defs = [f"--define-macro={k}={v}" for k, v in opts.defines]
    return [f"-arch=sm_{opts.arch}", *defs, f"--std={opts.std}"]


def origins(source: str) -> list[str]:
    """For each line of ``expand_includes(source)``, the ``file:line`` it came from (headers'
    ``#pragma once`` lines are dropped there, so their lines are counted here from the file)."""
    out: list[str] = []
    stack: list[tuple[str, list[int], int]] = []  # (file, its kept line numbers, next index)
    top = (source, list(range(1, len((KERNEL_DIR / source).read_text().splitlines()) + 1)), 0)
    stack.append(top)
    for text in expand_includes(KERNEL_DIR / source).splitlines():
        m = _MARK.match(text)
        name, kept, i = stack[-1]
        if m and m.group(1):  # end of a header: the include line of its parent is consumed
            stack.pop()
            name, kept, i = stack[-1]
            stack[-1] = (name, kept, i + 1)
            out.append(f"{name}:{kept[i]}")
            continue
        if m:
            lines = (KERNEL_DIR / m.group(2)).read_text().splitlines()
            out.append(f"{name}:{kept[i]}")
            keep = [n for n, t in enumerate(lines, 1) if t != "#pragma once"]
            stack.append((m.group(2), keep, 0))
            continue
        out.append(f"{name}:{kept[i] if i < len(kept) else '?'}")
        stack[-1] = (name, kept, i + 1)
    return out


def _name_lines(source: str, log: str) -> str:
    """``log`` with each ``source(N)`` followed by the file and line it came from."""
    where = origins(source)

    def sub(m: re.Match[str]) -> str:
        n = int(m.group(1))
        return f"{m.group(0)} [{where[n - 1]}]" if 0 < n <= len(where) else m.group(0)

    return re.sub(rf"{re.escape(source)}\((\d+)\)", sub, log)


def parse_usage(log: str) -> list[KernelUsage]:
    """Per entry function, what ``ptxas -v`` reports in ``log``. ptxas lists a function the
    entry calls (not inlined, e.g. libdevice's trig slow path) after it: its spills count as
    the entry's."""
    out: list[KernelUsage] = []
    props = ""
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            out.append(KernelUsage(m.group(1)))
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif out and (m := _SPILL.search(line)):
            k = out[-1]
            stack, stores, loads = (int(g) for g in m.groups())
            if props == k.name:
                k.stack, k.spill_stores, k.spill_loads = stack, stores, loads
            else:
                k.spill_stores, k.spill_loads = k.spill_stores + stores, k.spill_loads + loads
        elif out and props == out[-1].name and (m := _REGS.search(line)):
            out[-1].registers = int(m.group(1))
            if s := _SMEM.search(line):
                out[-1].smem = int(s.group(1))
    return out


def compile_variant(v: Variant, arch: str) -> Compiled:
    """NVRTC on one variant for ``sm_<arch>`` (``sm_<arch>a`` for an sm90a one): the cubin is
    dropped, the log parsed."""
    from cuda.bindings import nvrtc

    ok_code = nvrtc.nvrtcResult.NVRTC_SUCCESS
    text = expand_includes(KERNEL_DIR / v.source).encode()
    target = arch.rstrip("a") + "a" if v.sm90a else arch
    opts = nvrtc_options(CompileOptions(arch=target, defines=v.defines))
    args = [o.encode() for o in [*opts, "--ptxas-options=-v"]]
    err, prog = nvrtc.nvrtcCreateProgram(text, v.source.encode(), 0, [], [])
    if err != ok_code:
        raise RuntimeError(f"nvrtcCreateProgram failed for {v.label}: {err}")
    t0 = time.perf_counter()
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(args), args)
        seconds = time.perf_counter() - t0
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\0 ").decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ok = result == ok_code
    if not ok:
        head = f"NVRTC failed to compile {KERNEL_DIR / v.source} ({result.name}):\n"
        log = head + _name_lines(v.source, log)
    defines = [[k, val] for k, val in v.defines]
    usage = parse_usage(log) if ok else []
    return Compiled(v.label, v.source, defines, ok, seconds, log, usage)


def check(
    chosen: Iterable[Variant], arch: str = "90", jobs: int = 0,
    done: Callable[[Compiled], None] | None = None,
) -> list[Compiled]:  # fmt: skip
    """Compile ``chosen`` on ``jobs`` threads (0: one per CPU this process may use); results
    in ``chosen``'s order, each also given to ``done`` once it and those before it are done.
    sm_90a variants (wgmma) only when ``arch`` is 90 or 90a: no other GPU runs them."""
    todo = [v for v in chosen if not v.sm90a or arch in ("90", "90a")]
    with ThreadPoolExecutor(max_workers=jobs or available_cpus()) as pool:
        futures = [pool.submit(compile_variant, v, arch) for v in todo]
        results = []
        for f in futures:
            results.append(f.result())
            if done is not None:
                done(results[-1])
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="90", help="GPU arch to compile for, sm_<ARCH> (default 90)")
    p.add_argument("--json", metavar="PATH", help="also write every result to this JSON file")
    p.add_argument("--jobs", type=int, default=0, help="compile threads (default: one per CPU)")
    p.add_argument("--only", metavar="TEXT", help="only the variants whose label contains TEXT")
    p.add_argument("--kernels", action="store_true", help="print every kernel's usage")


def _print(r: Compiled, every_kernel: bool) -> None:
    worst = max(r.kernels, key=lambda k: k.registers, default=None)
    most = f"max {worst.registers} regs ({worst.name})" if worst else ""
    status = "ok" if r.ok else "FAILED"
    print(f"{r.label:44s} {r.seconds:6.2f} s  {status:6s} {len(r.kernels):3d} kernels  {most}")
    for k in r.kernels:
        if every_kernel or k.spills:
            spill = f"spills {k.spill_stores}/{k.spill_loads} B" if k.spills else "no spills"
            print(f"    {k.name:40s} {k.registers:4d} regs  {spill:18s} smem {k.smem} B")
    if not r.ok:
        print("    " + r.log.replace("\n", "\n    ").rstrip())


def chosen_variants(only: str | None) -> list[Variant]:
    """kernel_variants.py's variants whose label contains ``only`` (all without it);
    ValueError where NVRTC cannot run here or none matches."""
    missing = nvrtc_missing()
    if missing:
        raise ValueError(missing)
    from mgserve.cuda.kernel_variants import variants

    chosen = [v for v in variants() if not only or only in v.label]
    if not chosen:
        raise ValueError(f"--only {only!r} matches no variant")
    return chosen


def run(args: argparse.Namespace) -> int:
    """Compile, print per variant (and kernels that spill), a summary; 1 on any failure."""
    if not re.fullmatch(r"\d+[a-z]?", args.arch):
        raise ValueError(f"--arch {args.arch!r}: expected a number such as 90 (sm_90) or 90a")
    chosen = chosen_variants(args.only)
    t0 = time.perf_counter()
    results = check(chosen, args.arch, args.jobs, lambda r: _print(r, args.kernels))
    wall = time.perf_counter() - t0
    failed = [r.label for r in results if not r.ok]
    usage = [(k, r.label) for r in results for k in r.kernels]
    print(
        f"\nsm_{args.arch}: {len(results)} variants, {len(failed)} failed, {len(usage)} kernels; "
        f"{wall:.1f} s wall, {sum(r.seconds for r in results):.1f} s compiling"
    )
    print("most registers: " + ", ".join(
        f"{k.name} {k.registers} ({label})"
        for k, label in sorted(usage, key=lambda u: -u[0].registers)[:8]
    ))  # fmt: skip
    spills = sorted({f"{label} {k.name}" for k, label in usage if k.spills})
    print(f"spills: {len(spills)} kernels" + "".join(f"\n    {s}" for s in spills))
    for label in failed:
        print(f"FAILED: {label}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if failed else 0
