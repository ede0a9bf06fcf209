"""``Kernels``: the compiled kernels of one GPU and the launches that run them.

One object per GPU, shared by every op family of the CUDA backend: kernels are compiled once per
(source, function, -D defines) through ``KernelCompiler`` (whose cubin cache makes restarts fast)
and launched through cuda.core on cuda.core's view of ``torch.cuda.current_stream()``, so kernels
and torch ops stay in one order and a CUDA graph capture sees both.

On sm_90 and later every launch allows programmatic dependent launch (``pdl``): a kernel starts
while the one before it finishes, prefetches its weights, and waits in ``grid_wait()`` for the
earlier kernels' results (kernels/pdl.cuh states the contract every kernel keeps).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from mgserve.cuda import runtime

if TYPE_CHECKING:
    from cuda.core import Kernel, Stream

    from mgserve.cuda.compiler import CompileOptions, KernelCompiler

Defines = tuple[tuple[str, str], ...]
SMEM_DEFAULT = 48 * 1024  # dynamic shared memory a kernel may use without opting in
MAX_GRID_Y = 65535  # a launch's grid y (and z) dimension at most


class Kernels:
    """Kernels by (source, name, defines) and the current stream of one GPU."""

    def __init__(self, compiler: KernelCompiler) -> None:
        self.compiler = compiler
        self.device = torch.device("cuda", compiler.device_index)
        self._kernels: dict[tuple[str, str, CompileOptions], Kernel] = {}
        self._smem: dict[tuple[str, str, CompileOptions], int] = {}  # dynamic smem allowed
        self._streams: dict[int, Stream] = {}
        arch = runtime.gpu_info(compiler.device_index).arch
        self.pdl = int(arch) >= 90
        # thread block clusters (kernels/cluster.cuh) exist from sm_90 on; cuda.core counts a
        # cluster launch's grid in clusters from 0.4 on (launch's ``cluster``)
        self.clusters = self.pdl and runtime.cuda_core_version() >= (0, 4)
        # warpgroup MMA (kernels/wgmma.cuh) is sm_90a's alone: H100 / H200, not later GPUs
        self.wgmma = arch == "90"

    def kernel(
        self, source: str, name: str, defines: Defines = (), smem: int = 0, sm90a: bool = False
    ) -> Kernel:
        """Function ``name`` of ``kernels/<source>`` compiled with ``defines`` (cached), allowed
        ``smem`` bytes of dynamic shared memory (above the 48 KB a launch gets by default).
        ``sm90a``: for sm_90a (wgmma; only where ``self.wgmma``)."""
        opts = self.compiler.options(defines=defines)
        if sm90a:
            if not self.wgmma:
                raise ValueError(f"kernels/{source}: sm_90a code on an sm_{opts.arch} GPU")
            opts = dataclasses.replace(opts, arch=opts.arch + "a")
        key = (source, name, opts)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.compiler.kernel(source, name, opts)
        if smem > self._smem.get(key, SMEM_DEFAULT):
            runtime.allow_smem(k, smem, self.compiler.device_index)
            self._smem[key] = smem
        return k

    def stream(self) -> Stream:
        """cuda.core's view of ``torch.cuda.current_stream()``: launch here to stay in torch's
        order (and inside a graph capture when one is running)."""
        ts = torch.cuda.current_stream(self.device)
        s = self._streams.get(ts.cuda_stream)
        if s is None:
            s = self._streams[ts.cuda_stream] = runtime.stream_from_torch(
                ts, self.compiler.device_index
            )
        return s

    def launch(self, kernel: Kernel, grid: int | tuple[int, ...], block: int | tuple[int, ...],
               *args: object, shmem: int = 0, stream: Stream | None = None,
               cluster: int | None = None) -> None:  # fmt: skip
        """Launch ``kernel`` on ``stream`` (default: the current one). Pass pointers as
        ``t.data_ptr()`` and scalars as ``np.int32`` / ``np.float32`` / ``np.int64`` (cuda.core
        needs sized numpy scalars). ``cluster``: CTAs per thread block cluster along x (sm_90;
        kernels/cluster.cuh); ``grid`` then counts clusters along x, as cuda.core's does."""
        from cuda.core import LaunchConfig, launch

        extra = {} if cluster is None else {"cluster": (cluster, 1, 1)}
        config = LaunchConfig(
            grid=grid, block=block, shmem_size=shmem, programmatic_stream_serialization=self.pdl,
            **extra,
        )  # fmt: skip
        launch(stream if stream is not None else self.stream(), config, kernel, *args)
