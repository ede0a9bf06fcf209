"""A stream whose kernels run on a fixed part of the GPU's SMs: a CUDA green context
(``--prefill-lane-sms``). The prefill lane's chunks run there, so the decoders' steps, launched
in the primary context at the highest priority, always find the remaining SMs free instead of
waiting for a long prompt GEMM's blocks to retire (core/engine/lanes.py, cuda/runner.py)."""

from __future__ import annotations

from typing import Any

import torch


def green_stream(
    device: torch.device, n_sms: int, model: Any = None
) -> tuple[Any, torch.cuda.Stream]:
    """(the green context, keep it alive; its stream) of ``n_sms`` SMs on ``device``;
    ValueError when this torch, driver or GPU cannot make one. ``model``'s decode forks on that
    stream run inline (ops/branch.py: a side stream of the primary context would use every
    SM), and its hyper-connection mixes leave thread block clusters (ops/hc_cluster.py)."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < n_sms < total:
        raise ValueError(f"--prefill-lane-sms {n_sms}: the GPU has {total} SMs (0 < N < {total})")
    try:
        from torch.cuda.green_contexts import GreenContext

        ctx: Any = GreenContext.create(num_sms=n_sms, device_id=device.index or 0)
        stream = ctx.Stream()
    except (ImportError, RuntimeError, TypeError, AttributeError) as e:
        raise ValueError(f"--prefill-lane-sms {n_sms}: no green context here ({e})") from e
    backend = getattr(model, "backend", None)
    branch = getattr(backend, "branch", None)
    if branch is not None:
        branch.inline_on(stream)
    without_clusters(backend)
    return ctx, stream


def without_clusters(backend: Any) -> bool:
    """The backend's hyper-connection mixes leave thread block clusters (ops/hc_cluster.py), for
    the whole process so that both lanes keep the same bits: a lane batch's decode rows run on a
    green context's stream, and a partition of SMs need not hold a cluster's 8 CTAs in one GPC.
    So do the QSA selections (ops/qsa_cuda.py; the same output either way). Whether the mixes
    were on."""
    qsa: Any = getattr(backend, "qsa", None)
    if getattr(qsa, "cluster", False):  # the same output either way: only where it runs
        qsa.cluster = False
    hc: Any = getattr(backend, "hc", None)
    if not getattr(hc, "cluster", False):
        return False
    hc.cluster = False
    return True
