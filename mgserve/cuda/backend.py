"""The device backend: one object per family of ops (ops/), composed into a ``Backend``, and the
model factory.

``torch_backend()`` runs the device models with plain PyTorch on any device (the CPU in CI, where
it is checked against the reference models; a GPU as a fallback). ``cuda_backend(i)`` runs them on
the NVRTC kernels of GPU i, each CUDA family holding its torch twin as the explicit fallback for
inputs no kernel covers. The device models call only ``backend.<family>.<op>``, so the two are
interchangeable op by op.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.launch import Kernels
from mgserve.cuda.models.base import DeviceLM
from mgserve.cuda.ops.act import ActCuda, ActTorch
from mgserve.cuda.ops.attention import AttentionTorch
from mgserve.cuda.ops.attention_cuda import AttentionCuda
from mgserve.cuda.ops.branch import Branches
from mgserve.cuda.ops.deltanet import DeltaNetTorch
from mgserve.cuda.ops.deltanet_cuda import DeltaNetCuda
from mgserve.cuda.ops.embed import EmbedCuda, EmbedTorch
from mgserve.cuda.ops.hc import HCTorch
from mgserve.cuda.ops.hc_cuda import HCCuda
from mgserve.cuda.ops.hgemm import HGemmTuning
from mgserve.cuda.ops.kv import KVCuda, KVTorch
from mgserve.cuda.ops.linear import LinearTorch
from mgserve.cuda.ops.linear_cuda import LinearCuda
from mgserve.cuda.ops.moe import MoeTorch
from mgserve.cuda.ops.moe_cuda import MoeCuda
from mgserve.cuda.ops.norm import NormCuda, NormTorch
from mgserve.cuda.ops.ple import Ple
from mgserve.cuda.ops.qsa import QsaTorch
from mgserve.cuda.ops.qsa_cuda import QsaCuda
from mgserve.cuda.ops.qsa_keys import BlockKeys
from mgserve.cuda.ops.rope import RopeCuda, RopeTorch
from mgserve.cuda.ops.route import RouteCuda, RouteTorch
from mgserve.cuda.ops.rowpath import RowPath
from mgserve.cuda.plan_sizes import Part
from mgserve.cuda.pools import PoolSize
from mgserve.cuda.tickets import Tickets

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
HYBRID_ARCHS = ("qwen3moe", "qwen3next", "qwen4exp")


@dataclass
class Backend:
    """Every op family of one backend; the families that need another hold it themselves."""

    dense: DenseWeights  # dequantized weights of the torch families (fallbacks included)
    kernels: Kernels | None  # the GPU's compiled kernels and stream; None for the torch backend
    embed: EmbedTorch | EmbedCuda
    kv: KVTorch | KVCuda
    attention: AttentionTorch | AttentionCuda
    qsa: QsaTorch | QsaCuda
    qsa_keys: BlockKeys
    linear: LinearTorch | LinearCuda
    moe: MoeTorch | MoeCuda
    route: RouteTorch | RouteCuda
    norm: NormTorch | NormCuda
    rope: RopeTorch | RopeCuda
    act: ActTorch | ActCuda
    deltanet: DeltaNetTorch | DeltaNetCuda
    hc: HCTorch | HCCuda
    ple: Ple
    path: RowPath  # the kind of step running: decode kernels or prompt GEMMs (ops/rowpath.py)
    branch: Branches  # decode steps' independent chains side by side (ops/branch.py)


def torch_backend() -> Backend:
    """All ops in PyTorch on the tensors' device."""
    dense = DenseWeights()
    linear, norm, rope = LinearTorch(dense), NormTorch(), RopeTorch()
    path = RowPath()  # the torch families take one path at any size
    return Backend(
        dense=dense,
        kernels=None,
        embed=EmbedTorch(),
        kv=KVTorch(),
        attention=AttentionTorch(),
        qsa=QsaTorch(),
        qsa_keys=BlockKeys(norm, rope),
        linear=linear,
        moe=MoeTorch(dense),
        route=RouteTorch(),
        norm=norm,
        rope=rope,
        act=ActTorch(),
        deltanet=DeltaNetTorch(),
        hc=HCTorch(dense),
        ple=Ple(linear, norm),
        path=path,
        branch=Branches(path),  # inline: side chains run in order
    )


def cuda_backend(
    device_index: int = 0,
    *,
    int8: bool = False,
    prefill_exact: bool = False,
    cublas_prefill: bool = False,
    pdl: bool = True,
    hgemm: HGemmTuning | None = None,
    kernels: Kernels | None = None,
    fused_decode: bool = True,
    cache_dir: Path | None = None,
) -> Backend:
    """The kernels of GPU ``device_index`` (compiled once; the cubin cache makes restarts fast).
    ``int8``: round activations to int8 groups in the decode products that have a dp4a kernel
    (faster, not exact; ops/linear_cuda.py). ``prefill_exact``: prompt chunks multiply fp32
    dequantized weights instead of f16 tiles (comparing whole models with the reference).
    ``cublas_prefill``: prompt chunks dequantize W to f16 for cuBLAS (and bucket the MoE experts)
    instead of the tensor-core kernels on GGUF blocks (qgemm.cu): faster or slower, and not
    batch-invariant; for comparison and as a fallback. ``pdl``: False launches every kernel
    after the previous one has finished (launch.py; for comparison: on GPUs before sm_90 it is off).
    ``hgemm``: the long prompts' f16 GEMM (ops/hgemm.py: tiles, and from how many rows it
    replaces qgemm.cu; the two give the same bits).
    ``kernels``: an existing ``Kernels`` to share (its GPU, not ``device_index``, is used).
    ``fused_decode``: decode steps run the fused kernels (int8 activations written by their
    producers, QSA block keys and DeltaNet gates inside other kernels: fewer launches, the same
    bits); False runs each piece as its own launch (tests compare the two). ``cache_dir``: the
    cubin cache's parent (``--cache-dir``; default ``env.cache_dir()``)."""
    from mgserve.cuda.compiler import KernelCompiler

    if kernels is None:
        kernels = Kernels(KernelCompiler(device_index, cache_dir))
    kernels.pdl = kernels.pdl and pdl
    dense = DenseWeights()
    linear = LinearCuda(kernels, LinearTorch(dense), hgemm=hgemm)
    tickets = Tickets(kernels.device)  # the counters of the last-CTA kernels (tickets.py)
    moe = MoeCuda(kernels, MoeTorch(dense), linear, tickets=tickets)
    linear.int8 = moe.int8 = int8
    linear.prefill_exact = moe.prefill_exact = prefill_exact
    linear.cublas_prefill = moe.cublas_prefill = cublas_prefill
    linear.fused_decode = fused_decode
    deltanet = DeltaNetCuda(kernels, DeltaNetTorch())
    deltanet.fused = fused_decode
    norm, rope = NormCuda(kernels, linear.x16), RopeCuda(kernels, RopeTorch())
    attention = AttentionCuda(kernels, AttentionTorch())
    branch = Branches(linear.path, kernels.device)
    return Backend(
        dense=dense,
        kernels=kernels,
        embed=EmbedCuda(kernels),
        kv=KVCuda(kernels, KVTorch()),
        attention=attention,
        qsa=QsaCuda(kernels, QsaTorch(), attention),
        qsa_keys=BlockKeys(norm, rope, kernels if fused_decode else None),
        linear=linear,
        moe=moe,
        route=RouteCuda(kernels, RouteTorch(), linear, tickets),
        norm=norm,
        rope=rope,
        act=ActCuda(kernels, linear.x16),
        deltanet=deltanet,
        hc=HCCuda(kernels, HCTorch(dense), linear, norm, branch=branch),
        ple=Ple(linear, norm),
        path=linear.path,
        branch=branch,
    )


INT8_MIN_BYTES = 1 << 30  # --activations auto: int8 from this many bytes of weights


def int8_activations(g: GGUFFile, activations: str) -> bool:
    """Whether decode's products take int8 activations for ``g`` under ``--activations``."""
    if activations != "auto":
        return activations == "int8"
    return sum(t.n_bytes for t in g.tensors.values()) >= INT8_MIN_BYTES


def load_device_model(
    g: GGUFFile,
    backend: Backend,
    device: torch.device,
    n_slots: int,
    n_ctx: int,
    type_k: str = "f16",
    type_v: str = "f16",
    part: Part | None = None,
) -> DeviceLM:
    """The device model of ``g`` with state for ``n_slots`` sessions of ``n_ctx`` tokens, plus one
    spare slot (index ``n_slots``) that pads CUDA-graph buckets; of ``part``'s layers only (a
    stage of a pipeline across processes: models/base.py), or all."""
    from mgserve.core.gguf.hparams import spec_from_gguf
    from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf
    from mgserve.cuda.models.dense import DenseLM
    from mgserve.cuda.models.hybrid import HybridLM
    from mgserve.cuda.models.qwen4exp import Qwen4ExpLM

    arch = g.architecture
    size = PoolSize(n_slots + 1, n_ctx, type_k, type_v)
    if arch in DENSE_ARCHS:
        return DenseLM(g, spec_from_gguf(g), backend, device, size, part)
    if arch in HYBRID_ARCHS:
        spec, hp = hybrid_spec_from_gguf(g)
        lm = Qwen4ExpLM if arch == "qwen4exp" else HybridLM
        return lm(g, spec, hp, backend, device, size, part)
    raise GGUFError(
        f"{g.path}: architecture {arch!r} is not supported on the device backend "
        f"(supported: {', '.join(DENSE_ARCHS + HYBRID_ARCHS)})"
    )
