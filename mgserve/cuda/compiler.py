"""NVRTC compilation of the ``.cu`` files in ``kernels/``, with an on-disk cubin cache.

A cubin is keyed by the source's SHA-256, the compile options, the target arch and the NVRTC
version, so editing a kernel, changing a flag or upgrading the toolkit each miss the cache, and
nothing else does. A warm start reads the cubin and loads it in milliseconds instead of spending
seconds in NVRTC. Entries are written to a temporary name and renamed, so a crash or a second
process never leaves a torn cubin behind. ``mgserve kernels build`` (prebuild.py) writes the
same files ahead of a first start, without a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mgserve import env, progress
from mgserve.cuda import runtime

if TYPE_CHECKING:
    from cuda.core import Kernel, ObjectCode

KERNEL_DIR = Path(__file__).parent / "kernels"
log = logging.getLogger(__name__)


_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"[ \t]*$', re.MULTILINE)


def expand_includes(path: Path) -> str:
    """The source of ``path`` with each ``#include "name.cuh"`` line replaced by that file of
    ``kernels/`` (once; ``#pragma once`` lines dropped). Done here rather than by NVRTC so the
    cubin cache key, a hash of this text, changes whenever a shared header does."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            header = KERNEL_DIR / name
            if not header.is_file():
                raise ValueError(f"{path}: included header {name!r} not found in {KERNEL_DIR}")
            body = header.read_text().replace("#pragma once\n", "")
            return f"// ---- {name} ----\n" + expand(body) + f"// ---- end of {name} ----"

        return _INCLUDE.sub(sub, text)

    return expand(path.read_text())


@dataclass(frozen=True)
class CompileOptions:
    arch: str  # "90": NVRTC emits sm_90 machine code, no PTX JIT at load
    std: str = "c++17"
    defines: tuple[tuple[str, str], ...] = ()  # -D NAME=VALUE: kernels specialised per call site

    def key(self) -> str:
        defs = ",".join(f"{k}={v}" for k, v in self.defines)
        return f"sm_{self.arch};{self.std};{defs}"


def cubin_name(source: str, source_text: bytes, opts: CompileOptions,
               nvrtc: tuple[int, int]) -> str:  # fmt: skip
    """The cache file name of ``kernels/<source>`` (its expanded text) compiled with ``opts`` by
    NVRTC ``nvrtc`` (major, minor)."""
    h = hashlib.sha256()
    for part in (source_text, opts.key().encode(), f"nvrtc {nvrtc[0]}.{nvrtc[1]}".encode()):
        h.update(part)
        h.update(b"\0")
    return f"{Path(source).stem}-sm{opts.arch}-{h.hexdigest()[:24]}.cubin"


def store(path: Path, cubin: bytes) -> None:
    """Write ``cubin`` to ``path`` through a temporary name and a rename (never torn), readable
    by every user (an image's prebuilt cubins serve whatever uid runs it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class CompileStats:
    compiles: int = 0  # NVRTC invocations (cache misses)
    disk_hits: int = 0  # cubins read from the cache directory
    seconds_compiling: float = 0.0
    log: list[str] = field(default_factory=list)  # one line per load: name, source, time


class KernelCompiler:
    """Loads kernels by (.cu file, function name), compiling each file once per option set."""

    def __init__(self, device_index: int = 0, cache_dir: Path | None = None) -> None:
        self.device_index = device_index
        self.cache_dir = (cache_dir or env.cache_dir()) / "kernels"
        self.stats = CompileStats()
        self._modules: dict[tuple[str, CompileOptions], ObjectCode] = {}
        runtime.device(device_index)  # make the context current before any module load

    def options(self, defines: tuple[tuple[str, str], ...] = ()) -> CompileOptions:
        return CompileOptions(arch=runtime.gpu_info(self.device_index).arch, defines=defines)

    def cache_path(self, source: str, source_text: bytes, opts: CompileOptions) -> Path:
        return self.cache_dir / cubin_name(source, source_text, opts, runtime.nvrtc_version())

    def module(self, source: str, opts: CompileOptions | None = None) -> ObjectCode:
        """The compiled module of ``kernels/<source>``: from memory, the disk cache, or NVRTC."""
        from cuda.core import ObjectCode

        opts = opts or self.options()
        memo = self._modules.get((source, opts))
        if memo is not None:
            return memo
        path = KERNEL_DIR / source
        if not path.is_file():
            raise ValueError(f"no kernel source {source!r} in {KERNEL_DIR}")
        text = expand_includes(path).encode()
        cubin_path = self.cache_path(source, text, opts)
        t0 = time.perf_counter()
        if cubin_path.is_file():
            cubin = cubin_path.read_bytes()
            self.stats.disk_hits += 1
            how = "cache"
        else:
            cubin = self._compile(source, text.decode(), opts)
            store(cubin_path, cubin)
            self.stats.compiles += 1
            self.stats.seconds_compiling += time.perf_counter() - t0
            how = "nvrtc"
            log.info("compiled kernels/%s (sm_%s) in %.1f s", source, opts.arch,
                     time.perf_counter() - t0)  # fmt: skip
        mod = ObjectCode.from_cubin(cubin, name=source)
        self._modules[(source, opts)] = mod
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.log.append(f"{source} sm_{opts.arch} {how} {ms:.1f} ms -> {cubin_path.name}")
        progress.kernel_ready(source, sum(1 for _ in KERNEL_DIR.glob("*.cu")))
        return mod

    def kernel(self, source: str, name: str, opts: CompileOptions | None = None) -> Kernel:
        return self.module(source, opts).get_kernel(name)

    def _compile(self, source: str, text: str, opts: CompileOptions) -> bytes:
        from cuda.core import Program, ProgramOptions

        popts = ProgramOptions(
            name=source,
            arch=f"sm_{opts.arch}",
            std=opts.std,
            define_macro=[(k, v) for k, v in opts.defines] or None,
        )
        program = Program(text, "c++", popts)
        try:
            obj = program.compile("cubin")
        except Exception as e:  # NVRTC's log is in the message; name the file too
            raise RuntimeError(f"NVRTC failed to compile {KERNEL_DIR / source}: {e}") from e
        finally:
            program.close()
        return bytes(obj.code)
