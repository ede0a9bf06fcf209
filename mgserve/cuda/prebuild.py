"""``mgserve kernels build``: the cubins a server compiles at its first start on a GPU, compiled
ahead without one.

A first start on a GPU compiles each kernel module it launches with NVRTC (a full-width qwen4exp
about forty, matvec.cu alone most of a minute on one core) and keeps the cubins in its cache
(``<--cache-dir>/kernels``, compiler.py). This writes the same files, under the names
``KernelCompiler`` looks them up by (``compiler.cubin_name``: the expanded source, the options,
the NVRTC version), for every variant of kernel_variants.py (what ``cuda_backend`` can request)
and each ``--arch``, so that start finds them all: in a container image's build step, on a
machine without a GPU, or before handing a checkout to a GPU machine whose time is scarce. A
cubin already in the directory is kept (its name says it is the same build), one in ``--reuse``
(an earlier build's directory: a container build's cache mount) copied. sm_90a variants
(wgmma) are built for arch 90 only, as the runtime asks for them there only. NVRTC must be the
one the server will run (its version is in the names: another one only misses, never misleads).
"""

from __future__ import annotations

import argparse
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mgserve import env
from mgserve.config import settings_from
from mgserve.cuda.compiler import KERNEL_DIR, CompileOptions, cubin_name, expand_includes, store
from mgserve.cuda.offline import chosen_variants, nvrtc_options
from mgserve.machine import available_cpus

if TYPE_CHECKING:
    from mgserve.cuda.kernel_variants import Variant


@dataclass(frozen=True)
class Built:
    label: str  # the variant's label, "@ sm_<arch>"
    path: Path  # the cubin's file in the cache
    how: str  # "built", "present" (kept), "reused" (copied from --reuse) or "failed"
    seconds: float
    error: str = ""


def options(v: Variant, arch: str) -> CompileOptions:
    """The options ``Kernels.kernel`` gives ``v``'s module on an sm_<arch> GPU."""
    return CompileOptions(arch=arch + "a" if v.sm90a else arch, defines=tuple(v.defines))


def compile_cubin(source: str, text: bytes, opts: CompileOptions) -> bytes:
    """NVRTC on ``text`` (``kernels/<source>`` expanded) with ``KernelCompiler._compile``'s
    options; RuntimeError with NVRTC's log when it fails."""
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(text, source.encode(), 0, [], [])
    if err != ok:
        raise RuntimeError(f"nvrtcCreateProgram failed for {source}: {err}")
    try:
        args = [o.encode() for o in nvrtc_options(opts)]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(args), args)
        if result != ok:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            buf = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.rstrip(b"\0 ").decode(errors="replace")
            raise RuntimeError(f"NVRTC failed to compile {KERNEL_DIR / source}: {log}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def build_one(v: Variant, arch: str, cache: Path, version: tuple[int, int],
              reuse: Path | None = None) -> Built:  # fmt: skip
    t0 = time.perf_counter()
    opts = options(v, arch)
    text = expand_includes(KERNEL_DIR / v.source).encode()
    name = cubin_name(v.source, text, opts, version)
    path, label = cache / name, f"{v.label} @ sm_{opts.arch}"
    if path.is_file():
        return Built(label, path, "present", time.perf_counter() - t0)
    if reuse is not None and (reuse / name).is_file():
        store(path, (reuse / name).read_bytes())
        return Built(label, path, "reused", time.perf_counter() - t0)
    try:
        cubin = compile_cubin(v.source, text, opts)
    except RuntimeError as e:
        return Built(label, path, "failed", time.perf_counter() - t0, str(e))
    store(path, cubin)
    if reuse is not None:
        store(reuse / name, cubin)  # for the next build
    return Built(label, path, "built", time.perf_counter() - t0)


def build(chosen: list[Variant], archs: list[str], cache: Path, jobs: int = 0,
          reuse: Path | None = None, progress: bool = False) -> list[Built]:  # fmt: skip
    """Every variant of ``chosen`` for every arch (sm_90a ones for 90 only) into ``cache`` (the
    ``kernels`` folder of a cache directory), on ``jobs`` threads (0: one per CPU); cubins of
    ``reuse`` copied rather than compiled, and what is compiled stored there too. ``progress``:
    a line at every tenth of the work."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    todo = [(v, a) for a in archs for v in chosen if not v.sm90a or a == "90"]
    out: list[Built] = []
    with ThreadPoolExecutor(max_workers=jobs or available_cpus()) as pool:
        done = pool.map(lambda va: build_one(va[0], va[1], cache, (major, minor), reuse), todo)
        for i, r in enumerate(done, 1):
            out.append(r)
            if progress and (10 * i // len(todo)) > (10 * (i - 1) // len(todo)):
                print(f"  {i}/{len(todo)} modules ({r.label})", flush=True)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arch", default="90",
        help="GPU archs to build for, comma-separated (default 90: H100 / H200; 86: RTX 3090)",
    )  # fmt: skip
    p.add_argument(
        "--cache-dir", metavar="DIR",
        help="the server's --cache-dir (cubins go to DIR/kernels; default: the server's, "
        "MGSERVE_CACHE_DIR or $XDG_CACHE_HOME/mgserve)",
    )  # fmt: skip
    p.add_argument(
        "--reuse", metavar="DIR",
        help="a folder of cubins from earlier builds (a container build's cache mount): copied "
        "where they match, and what is compiled is added to it",
    )  # fmt: skip
    p.add_argument("--only", metavar="TEXT", help="only the variants whose label contains TEXT")
    p.add_argument("--jobs", type=int, default=0, help="compile threads (default: one per CPU)")


def run(args: argparse.Namespace) -> int:
    """Build, print a line a failure and a summary; 1 if any variant failed to compile."""
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    for a in archs:
        if not re.fullmatch(r"\d+", a):
            raise ValueError(f"--arch {a!r}: expected numbers such as 90 or 86,90")
    if not archs:
        raise ValueError("--arch: no arch given")
    chosen = chosen_variants(args.only)
    cache = env.cache_dir(args.cache_dir or settings_from().cache_dir) / "kernels"
    reuse = Path(args.reuse) if args.reuse else None
    t0 = time.perf_counter()
    results = build(chosen, archs, cache, args.jobs, reuse, progress=True)
    hows = ("built", "present", "reused", "failed")
    count = {how: sum(r.how == how for r in results) for how in hows}
    for r in results:
        if r.how == "failed":
            print(f"FAILED: {r.label}\n    " + r.error.replace("\n", "\n    ").rstrip())
    size = sum(r.path.stat().st_size for r in results if r.how != "failed")
    print(
        f"{cache}: {count['built']} built, {count['present']} already there, "
        f"{count['reused']} reused, {count['failed']} failed; sm_{', sm_'.join(archs)}; "
        f"{size / 2**20:.1f} MiB; "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 1 if count["failed"] else 0
