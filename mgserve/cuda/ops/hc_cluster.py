"""A decode mix on thread block clusters (``HCCuda.cluster``, on by default where the GPU has
clusters; kernels/hc.cu's hc_downc and hc_upl, kernels/cluster.cuh).

hc_down gives each CTA one stream's whole row slice, so at 8 tokens (qwen4exp: d = 2560) it stages
the stream in five parts one after another and runs 84 CTAs on 132 SMs; hc_up then sums the
streams' partial products again in every CTA's prologue. Here a cluster of hc * pieces CTAs shares
a row block: each CTA stages and multiplies one slice of d / pieces values of one stream in a
single part and stores its partial sums into the shared memory of the cluster's rank 0, which adds
them in rank order, applies the norm scales and the activations, and writes the mix's low-rank
values, the inject and the norm scales themselves. hc_upl reads those instead of summing streams.
A green-context prefill lane turns the clusters off for the process (cuda/green.py).

The pieces depend on (hc, d) only, never on the token count, and every sum runs in a fixed order,
so a token's bits do not depend on its batch. The sums are grouped differently from hc_down's, so
the bits differ from that path's (both are within the tests' tolerance of the reference).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.ops.hc import (
    HC_SOURCE,
    MAX_TOKEN_GROUP,
    down_and_inject,
    stream_args,
    up_smem,
)

if TYPE_CHECKING:
    from mgserve.cuda.launch import Kernels
    from mgserve.cuda.ops.branch import Branches
    from mgserve.cuda.ops.hc import HCTuning
    from mgserve.cuda.ops.linear_tuning import Q8Activations
from mgserve.cuda.weights import QuantWeight

CLUSTER_MAX = 8  # CTAs in a cluster at most (the portable size; kernels/cluster.cuh)
# a CTA's staged slice at most (above 48 KB by opting in); with the static arrays well inside
# every sm_90+ part's per-block limit (99 KB on sm_120); qwen4exp's is 40 KB
CLUSTER_SMEM = 64 * 1024


def static_smem(tune: HCTuning, nt: int) -> int:
    """Bytes of hc_downc's static shared memory for nt tokens: the per-warp sums of squares and
    rank 0's copies of every rank's sums and products."""
    rows = tune.down_rows_per_cta(nt)
    return 4 * nt * (tune.down_warps + CLUSTER_MAX + CLUSTER_MAX * rows)


@functools.cache  # asked on every decode mix a graph does not replay
def cluster_pieces(hc: int, d: int, smem: int = CLUSTER_SMEM) -> int | None:
    """Slices per stream of a cluster (of hc * pieces CTAs): the most that fit the cluster, divide
    d into runs of 8 values and stage 8 tokens' slice in ``smem`` bytes; None when there are none
    (the unclustered kernels run). Shapes only: never the token count."""
    for pieces in range(CLUSTER_MAX // max(hc, 1), 0, -1):
        pl = d // pieces
        if d % pieces == 0 and pl % 8 == 0 and MAX_TOKEN_GROUP * pl * 4 <= smem:
            return pieces
    return None


def mix_clustered(
    kernels: Kernels,
    tune: HCTuning,
    branch: Branches,
    pieces: int,
    streams: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    norm: torch.Tensor,
    weights: tuple[QuantWeight, QuantWeight, QuantWeight | None],
    nt: int,
    eps: float,
    xq: Q8Activations | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mixed, inject) of a mix whose inputs HCCuda._run checked: ``streams`` = (x, out_prev,
    inj_prev, x_new), the last three None unless the previous combine is fused (x_new is then
    written here); ``nt`` tokens per group. ``xq`` [n, d]: written with mixed rounded to int8
    (``tune.xq`` and ``tune.writes_xq(nt, d)`` must hold)."""
    if (xq is not None) != tune.xq:  # hc_uplq is only in the xq module, hc_upl only outside it
        raise ValueError(f"mix_clustered: xq given: {xq is not None}, tuning.xq {tune.xq}")
    x, out_prev, inj_prev, x_new = streams
    if xq is not None and not tune.writes_xq(nt, x.shape[2]):  # hc_uplq's barrier needs it
        raise ValueError(f"mix_clustered: CTAs of {tune.up_cols_per_cta(nt)} columns cannot "
                         f"write the int8 form of {x.shape[2]} columns")  # fmt: skip
    down, up, inject = weights
    n, hc, d = x.shape
    r = down.rows
    groups = (n + nt - 1) // nt
    csize = hc * pieces
    dev = x.device
    low = torch.empty(n, r, dtype=torch.float32, device=dev)
    inv = torch.empty(n, hc, dtype=torch.float32, device=dev)
    mixed = torch.empty(n, d, dtype=torch.float32, device=dev)
    inj = torch.empty(n, hc, dtype=torch.float32, device=dev) if inject is not None else None
    per_cluster = tune.down_rows_per_cta(nt)
    smem = nt * (d // pieces) * 4
    allow = smem + static_smem(tune, nt)  # past 48 KB in all: opted in (Kernels.kernel)

    def down_launch(wa: QuantWeight, wb: QuantWeight | None, col0: int, aux: int) -> None:
        rows = wa.rows + (wb.rows if wb is not None else 0)
        kernels.launch(
            kernels.kernel(
                HC_SOURCE,
                f"hc_downc_{wa.type_name}_t{nt}",
                tune.defines(wa.type_name, clustered=True),
                allow,
            ),
            ((rows + per_cluster - 1) // per_cluster, groups),
            32 * tune.down_warps,
            *stream_args(x, norm, (out_prev, inj_prev, x_new), wa, wb),
            low.data_ptr(),
            inj.data_ptr() if inj is not None else 0,
            inv.data_ptr(),
            np.int32(n),
            np.int32(hc),
            np.int32(d),
            np.int32(pieces),
            np.int32(r),
            np.int32(col0),
            np.int32(aux),
            np.float32(eps),
            shmem=smem,
            cluster=csize,
        )

    down_and_inject(branch, down, inject, down_launch, r)  # the inject's writes only inj

    per_cta = tune.up_cols_per_cta(nt)
    name = "hc_upl" if xq is None else "hc_uplq"  # hc_uplq: also the int8 form, xq
    kernels.launch(
        kernels.kernel(
            HC_SOURCE, f"{name}_{up.type_name}_t{nt}", tune.defines(up.type_name, clustered=True)
        ),
        ((d + per_cta - 1) // per_cta, groups),
        32 * tune.up_warps,
        up.data.data_ptr(),
        low.data_ptr(),
        inv.data_ptr(),
        (x_new if x_new is not None else x).data_ptr(),
        norm.data_ptr(),
        mixed.data_ptr(),
        *(() if xq is None else (xq.q.data_ptr(), xq.d.data_ptr())),
        np.int32(n),
        np.int32(hc),
        np.int32(d),
        np.int32(r),
        np.float32(eps),
        shmem=up_smem(nt, r, hc),
    )
    return mixed, inj
