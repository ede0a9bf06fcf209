"""Hyper-connections (qwen4exp): the residual is ``hc`` parallel streams per token, and every block
reads a learned mix of them and writes its output back into each with its own weight.

In place of a pre-norm (HF ``Qwen4ExpTextGatedResidual``, llama.cpp ``build_hc_mix`` /
``build_hc_combine``), for streams x [hc, d]::

    xn     = rms_norm(x, per stream) * gamma                    # gamma [hc, d], stored 1 + w
    gate   = sigmoid(up(silu(down(flat(xn)) / hc)))             # low-rank: hc*d -> r -> hc*d
    input  = mean_over_streams(gate * xn)                       # [d]: what the block reads
    inject = 2 * sigmoid(w_inject . flat(xn) / hc)              # [hc], centred on 1
    x      = x + inject[:, None] * block(input)                 # combine

The head has the same mix without the inject, in place of the output norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from mgserve.core.reference import ops, rowwise


@dataclass
class HCWeights:  # [out, in] float32
    norm: torch.Tensor  # [hc, d] per-stream RMSNorm gammas (1 + w)
    down: torch.Tensor  # [r, hc * d]
    up: torch.Tensor  # [hc * d, r]
    inject: torch.Tensor | None  # [hc, hc * d]; None for the head's mix


def grouped_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each stream of x [N, hc, d], scaled by gamma [hc, d]."""
    return ops.rms_norm(x, gamma, eps)


Project = Callable[[torch.Tensor], torch.Tensor]  # x [N, in] -> x @ W^T [N, out]
GateMix = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (u, xn) [N, hc, d] -> [N, d]
# xn [N, hc * d] -> (down(xn) [N, r], inject(xn) [N, hc]) in one call
DownInject = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def mix(
    x: torch.Tensor, w: HCWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:  # input [N, d], inject [N, hc] or None
    """What a block reads from the streams x [N, hc, d], and how strongly it writes back."""
    inject = None if w.inject is None else partial(ops.linear, w=w.inject)
    return mix_with(
        x, w.norm, eps, partial(ops.linear, w=w.down), partial(ops.linear, w=w.up), inject
    )


def mix_with(
    x: torch.Tensor,  # [N, hc, d]
    gamma: torch.Tensor,  # [hc, d]
    eps: float,
    down: Project,  # [N, hc * d] -> [N, r]
    up: Project,  # [N, r] -> [N, hc * d]
    inject: Project | None,  # [N, hc * d] -> [N, hc]; None for the head's mix
    norm: ops.NormFn = grouped_norm,
    gate_mix: GateMix | None = None,
    down_inject: DownInject | None = None,
    up_gate_mix: GateMix | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # input [N, d], inject [N, hc] or None
    """``mix`` with the projections (and the norm, and the gated mean over the streams) given as
    functions: the device backend runs this same arithmetic with its own products and kernels.
    ``down_inject``: both of xn's projections from one call (for ``down`` and ``inject``);
    ``up_gate_mix``: (low [N, r], xn [N, hc, d]) -> the gated mean of up(low), in one call."""
    n, hc, d = x.shape
    xn = norm(x, gamma, eps).reshape(n, hc * d)  # [N, hc * d]
    raw_down, raw_inject = down_inject(xn) if down_inject is not None else (down(xn), None)
    if inject is not None and raw_inject is None:  # both of xn's products before anything else
        raw_inject = inject(xn)  # (a device backend's f16 copy of xn is then still at hand)
    low = rowwise.silu(raw_down / hc)  # [N, r]
    if up_gate_mix is not None:
        mixed = up_gate_mix(low, xn.view(n, hc, d))
    else:
        mixed = (gate_mix or gated_mean)(up(low).view(n, hc, d), xn.view(n, hc, d))  # [N, d]
    if raw_inject is None:  # the head's mix
        return mixed, None
    return mixed, 2.0 * rowwise.sigmoid(raw_inject / hc)  # [N, hc]


def gated_mean(u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
    """[N, d]: the streams of xn [N, hc, d] gated by sigmoid(u) [N, hc, d], summed in stream
    order and divided by hc."""
    n, hc, d = u.shape
    gate = rowwise.sigmoid(u.reshape(n, hc * d)).view(n, hc, d)  # rows of the whole token
    return rowwise.sum_in_order(gate * xn, 1) / hc


def combine(x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """x [N, hc, d] + inject [N, hc] x out [N, d] broadcast over the streams."""
    return x + inject[:, :, None] * out[:, None, :]
