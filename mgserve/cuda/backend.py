"""The device backend: every op family composed into one object, and the model factory.

``TorchBackend`` runs the device models with plain PyTorch on any device (the CPU in CI, where it
is checked against the reference models; a GPU as a fallback). ``CudaBackend`` overrides each op
with its NVRTC kernels. The device models only ever call the backend, so the two are
interchangeable op by op (see kbase.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.cuda.attention import AttentionCuda, AttentionTorch
from mgserve.cuda.hc import HCCuda, HCTorch
from mgserve.cuda.matmul import MatmulCuda, MatmulTorch
from mgserve.cuda.models.base import DeviceLM, DeviceOps
from mgserve.cuda.route import RouteCuda, RouteTorch
from mgserve.cuda.smallops import SmallOpsCuda, SmallOpsTorch

if TYPE_CHECKING:
    from mgserve.cuda.compiler import KernelCompiler

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
HYBRID_ARCHS = ("qwen3moe", "qwen3next", "qwen4exp")


class TorchBackend(AttentionTorch, MatmulTorch, SmallOpsTorch, HCTorch, RouteTorch):
    """All ops in PyTorch on the tensors' device."""


class CudaBackend(AttentionCuda, MatmulCuda, SmallOpsCuda, HCCuda, RouteCuda):
    """All ops as NVRTC kernels on torch's current stream (torch versions where none exists)."""


def cuda_backend(device_index: int = 0, *, int8: bool = False) -> CudaBackend:
    """The kernels of GPU ``device_index`` (compiled once; the cubin cache makes restarts fast).
    ``int8``: round activations to int8 groups in the matvecs that have a dp4a kernel (faster,
    not exact; see ops.py)."""
    from mgserve.cuda.compiler import KernelCompiler

    compiler: KernelCompiler = KernelCompiler(device_index)
    backend = CudaBackend(compiler)
    backend.int8 = int8
    return backend


def load_device_model(
    g: GGUFFile,
    ops: TorchBackend | CudaBackend,
    device: torch.device,
    n_slots: int,
    n_ctx: int,
    type_k: str = "f16",
    type_v: str = "f16",
) -> DeviceLM:
    """The device model of ``g`` with state for ``n_slots`` sessions of ``n_ctx`` tokens, plus one
    spare slot (index ``n_slots``) that pads CUDA-graph buckets."""
    from mgserve.core.gguf.hparams import spec_from_gguf
    from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf
    from mgserve.cuda.models.dense import DenseLM
    from mgserve.cuda.models.hybrid import HybridLM

    arch = g.architecture
    pools = (n_slots + 1, n_ctx, type_k, type_v)
    # the op families spell their keyword arguments out; DeviceOps lists them as **kw
    dev_ops = cast(DeviceOps, ops)
    if arch in DENSE_ARCHS:
        return DenseLM(g, spec_from_gguf(g), dev_ops, device, *pools)
    if arch in HYBRID_ARCHS:
        spec, hp = hybrid_spec_from_gguf(g)
        return HybridLM(g, spec, hp, dev_ops, device, *pools)
    raise GGUFError(
        f"{g.path}: architecture {arch!r} is not supported on the device backend "
        f"(supported: {', '.join(DENSE_ARCHS + HYBRID_ARCHS)})"
    )
