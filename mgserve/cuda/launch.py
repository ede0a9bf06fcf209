"""``Kernels``: the compiled kernels of one GPU and the launches that run them.

One object per GPU, shared by every op family of the CUDA backend: kernels are compiled once per
(source, function, -D defines) through ``KernelCompiler`` (whose cubin cache makes restarts fast)
and launched through cuda.core on cuda.core's view of ``torch.cuda.current_stream()``, so kernels
and torch ops stay in one order and a CUDA graph capture sees both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cuda.core import Kernel, Stream

    from mgserve.cuda.compiler import CompileOptions, KernelCompiler

Defines = tuple[tuple[str, str], ...]


class Kernels:
    """Kernels by (source, name, defines) and the current stream of one GPU."""

    def __init__(self, compiler: KernelCompiler) -> None:
        self.compiler = compiler
        self.device = torch.device("cuda", compiler.device_index)
        self._kernels: dict[tuple[str, str, CompileOptions], Kernel] = {}
        self._streams: dict[int, Stream] = {}
        self._smem: dict[int, int] = {}  # id(kernel) -> dynamic shared memory it may use

    def kernel(self, source: str, name: str, defines: Defines = ()) -> Kernel:
        """Function ``name`` of ``kernels/<source>`` compiled with ``defines`` (cached)."""
        opts = self.compiler.options(defines=defines)
        key = (source, name, opts)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.compiler.kernel(source, name, opts)
        return k

    def allow_smem(self, kernel: Kernel, nbytes: int) -> None:
        """Let ``kernel`` use ``nbytes`` of dynamic shared memory (above the 48 KB default)."""
        if self._smem.get(id(kernel), -1) < nbytes:
            from mgserve.cuda import runtime

            runtime.allow_dynamic_smem(kernel, nbytes, self.compiler.device_index)
            self._smem[id(kernel)] = nbytes

    def stream(self) -> Stream:
        """cuda.core's view of ``torch.cuda.current_stream()``: launch here to stay in torch's
        order (and inside a graph capture when one is running)."""
        from mgserve.cuda import runtime

        ts = torch.cuda.current_stream(self.device)
        s = self._streams.get(ts.cuda_stream)
        if s is None:
            s = self._streams[ts.cuda_stream] = runtime.stream_from_torch(
                ts, self.compiler.device_index
            )
        return s

    def launch(self, kernel: Kernel, grid: int | tuple[int, ...], block: int | tuple[int, ...],
               *args: object, shmem: int = 0, stream: Stream | None = None) -> None:  # fmt: skip
        """Launch ``kernel`` on ``stream`` (default: the current one). Pass pointers as
        ``t.data_ptr()`` and scalars as ``np.int32`` / ``np.float32`` / ``np.int64`` (cuda.core
        needs sized numpy scalars)."""
        from cuda.core import LaunchConfig, launch

        config = LaunchConfig(grid=grid, block=block, shmem_size=shmem)
        launch(stream if stream is not None else self.stream(), config, kernel, *args)
