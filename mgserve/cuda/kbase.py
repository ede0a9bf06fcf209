"""What every op family of the device backend shares (DESIGN.md: ops.py, one checked wrapper per
kernel family).

Each family (attention, MoE and matmul, small ops, ...) is written twice, as a pair of mixins:

- ``<Family>Torch``: plain PyTorch on whatever device the tensors live on. It runs on the CPU in
  CI, is the fallback on a GPU, and is written with static shapes and no host synchronisation
  wherever a decode step uses it, so a decode step captures into a CUDA graph with it too.
- ``<Family>Cuda(<Family>Torch)``: the same methods launching NVRTC kernels through cuda.core on
  torch's current stream (so kernels and torch ops stay in one order, and graph capture sees them).

``TorchBase`` / ``CudaBase`` give the mixins the helpers they need: the dequantized form of a
``QuantWeight`` (torch side), compiled kernels and the current stream (CUDA side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mgserve.cuda.weights import FORMATS, QuantWeight

if TYPE_CHECKING:
    from cuda.core import Kernel, Stream

    from mgserve.cuda.compiler import CompileOptions, KernelCompiler


class KVLayer(NamedTuple):
    """One attention layer's K (or V) for every slot of a device pool.

    q8_0: ``values`` int8 [n_slots, n_ctx, n_kv, head_dim], ``scales`` float16
    [n_slots, n_ctx, n_kv, head_dim / 32] (x ~= values * scale per 32 values, rounded exactly as
    ``mgserve.core.models.kvcache.quantize_q8_0``). f16 / f32: ``values`` of that dtype,
    ``scales`` empty.
    Both are contiguous views of the pool's layer.
    """

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.values.dtype == torch.int8


def dequantize_weight(w: QuantWeight) -> torch.Tensor:
    """float32 [rows, k] of a QuantWeight, on the weight's device (through gguf-py on the host:
    slow, for the torch backend and tests only)."""
    from gguf import GGMLQuantizationType, quants

    raw = w.data.cpu().numpy().reshape(-1)
    if w.type_name == "F32":
        values = raw.view(np.float32)
    elif w.type_name == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif w.type_name == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        values = quants.dequantize(raw, GGMLQuantizationType[w.type_name])
    dense = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(w.rows, w.k)
    return dense.to(w.data.device)


class TorchBase:
    """Dequantized weights, made once per QuantWeight and kept (keyed by the weight's storage)."""

    def __init__(self) -> None:
        self._dense: dict[int, torch.Tensor] = {}

    def dense(self, w: QuantWeight) -> torch.Tensor:
        """float32 [rows, k] of ``w`` (cached)."""
        key = w.data.data_ptr()
        d = self._dense.get(key)
        if d is None or d.shape != (w.rows, w.k):
            d = self._dense[key] = dequantize_weight(w)
        return d


class CudaBase(TorchBase):
    """Kernels by (source, name, defines) and cuda.core's view of torch's current stream."""

    def __init__(self, compiler: KernelCompiler) -> None:
        super().__init__()
        self.compiler = compiler
        self.device = torch.device("cuda", compiler.device_index)
        self._kernels: dict[tuple[str, str, CompileOptions], Kernel] = {}
        self._streams: dict[int, Stream] = {}

    def kernel(self, source: str, name: str, defines: tuple[tuple[str, str], ...] = ()) -> Kernel:
        """Function ``name`` of ``kernels/<source>`` compiled with ``defines`` (cached)."""
        opts = self.compiler.options(defines=defines)
        key = (source, name, opts)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.compiler.kernel(source, name, opts)
        return k

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
               *args: object, shmem: int = 0) -> None:  # fmt: skip
        """Launch ``kernel`` on the current stream. Pass pointers as ``t.data_ptr()`` and scalars
        as ``np.int32`` / ``np.float32`` / ``np.int64`` (cuda.core needs sized numpy scalars)."""
        from cuda.core import LaunchConfig, launch

        config = LaunchConfig(grid=grid, block=block, shmem_size=shmem)
        launch(self.stream(), config, kernel, *args)


def check_cuda(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError unless ``t`` is a contiguous ``dtype`` tensor on ``device``."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def shape_error(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {list(t.shape)}, expected {expected}")


def check_f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, n: int) -> None:
    """``t`` is a [n] int32 or int64 tensor (slots, positions, lengths)."""
    if t.dim() != 1 or t.shape[0] != n:
        raise shape_error(name, t, f"[{n}]")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def check_weight(w: QuantWeight, device: torch.device) -> None:
    """ValueError unless ``w`` is whole, contiguous, 16-byte aligned uint8 blocks on ``device``
    of a type the kernels read."""
    fmt = FORMATS.get(w.type_name)
    if fmt is None:
        raise ValueError(f"{w.name}: no CUDA kernel for type {w.type_name}")
    if w.data.device != device or w.data.dtype != torch.uint8:
        raise ValueError(f"{w.name}: weight bytes must be uint8 on {device}")
    if (
        not w.data.is_contiguous()
        or w.data.numel() != w.rows * (w.k // fmt.block) * fmt.nbytes
        or w.data.data_ptr() % 16
    ):
        raise ValueError(f"{w.name}: weight bytes must be contiguous, 16-byte aligned, whole")
