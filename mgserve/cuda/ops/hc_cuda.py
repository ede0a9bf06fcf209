"""``HCCuda``: the hc family on kernels/hc.cu (see ops/hc.py for the math and the kernels'
layout), and on the linear family's GEMMs for prompt chunks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from mgserve.cuda.checks import check_weight, vec4_input
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops import hc_prompt
from mgserve.cuda.ops.branch import Branches
from mgserve.cuda.ops.hc import (
    CLUSTER_TUNING,
    CLUSTER_XQ_TUNING,
    DYNAMIC_SMEM,
    HC_SOURCE,
    MAX_TOKEN_GROUP,
    HCTorch,
    HCTuning,
    check_combine,
    check_mix,
    down_and_inject,
    down_part,
    stream_args,
    token_group,
    up_smem,
)
from mgserve.cuda.ops.hc_cluster import cluster_pieces, mix_clustered
from mgserve.cuda.ops.linear_cuda import LinearCuda
from mgserve.cuda.ops.norm import NormCuda
from mgserve.cuda.weights import FORMATS, QuantWeight


class HCCuda:
    """The mix and combine on kernels/hc.cu (see the module docstring). Activations must be
    float32 on this device; weights of every format in weights.FORMATS run on the kernels, shapes
    the kernels cannot stage on the torch version. ``tuning`` sets the kernels' compile-time
    shape."""

    def __init__(
        self,
        kernels: Kernels,
        fallback: HCTorch,
        linear: LinearCuda,
        norm: NormCuda,
        tuning: HCTuning | None = None,
        branch: Branches | None = None,
    ) -> None:
        self.kernels, self.fallback, self.linear, self.norm = kernels, fallback, linear, norm
        # decode: a separate inject launch beside the down's (branch.py); inline by default
        self.branch = branch if branch is not None else Branches(linear.path)
        self.device = kernels.device
        self.tuning = tuning or HCTuning()
        # the prompt mix's gated mean in one kernel (hc_gate_mix) instead of six torch ops a
        # stream, bitwise those ops (tests/cuda/test_hc.py); False runs the torch ops
        self.prompt_gate_kernel = True
        # a prompt mix's combine and norm in one kernel (NormCuda.combine_rms: the same bits,
        # one pass over the streams fewer); False: hc_combine, then the norm. With the f16
        # copies, a 4096-token chunk +4.2% on an H100 (BENCHMARKS.md 2026-12-07 21:47)
        self.prompt_combine_norm = True
        # a prompt mix's up GEMM and gated mean in one kernel (hc_prompt.up_gate_mix: the same
        # bits, u [N, hc d] neither written nor read); bitwise, and 5.8% slower on an H100
        # (BENCHMARKS.md 2026-12-07 21:46: the epilogue's scattered loads and stores): off
        self.prompt_up_gate = False
        # a prompt mix's down and inject projections in one GEMM (linear_stacked.py): the same
        # bits (test_hc.py::test_prompt_mix_stacks_inject_bitwise), one GEMM fewer a mix; +1.8%
        # on a 4096-token chunk on an H100 (BENCHMARKS.md 2026-12-07 21:47)
        self.stack_inject = True
        # decode mixes on thread block clusters (hc_cluster.py: hc_downc + hc_upl) on sm_90 and
        # later, where the shapes allow; other bits than hc_down + hc_up, batch-invariant as
        # they are. On the H100 (2026-12-06 14:29, bench model --paired 5 --toggle hc.cluster):
        # the same decode rate for one session, +3.5% for five. A green-context prefill lane
        # turns it off for the process (green.py)
        self.cluster = kernels.clusters
        self.cluster_tuning = CLUSTER_TUNING
        # a clustered decode mix also writes its output rounded to int8 (hc_upl on
        # CLUSTER_XQ_TUNING's 32-column CTAs), handed to ``linear.quantize`` (q8.offer): one
        # quantize launch fewer a mix. Bitwise, and slower on the H100 (BENCHMARKS.md 2026-12-06
        # 22:43): off
        self.emit_xq = False
        self.stage_hoist = True  # False: HCTuning.stage_hoist off in the clustered mixes

    # -- helpers --

    @staticmethod
    def kernels_apply(hc: int, d: int, r: int, weights: tuple[QuantWeight | None, ...]) -> bool:
        """Whether the kernels run a mix of these shapes and weights. Depends on shapes and
        formats only, never on N, so a token's results never depend on the batch."""
        if any(w is not None and w.type_name not in FORMATS for w in weights):
            return False
        if d % 8 or r % 8 or d <= 0 or r <= 0:
            return False
        return (
            down_part(d, MAX_TOKEN_GROUP) is not None
            and up_smem(MAX_TOKEN_GROUP, r, hc) <= DYNAMIC_SMEM
        )

    def _emits_xq(self, n: int, d: int, nt: int, inject: QuantWeight | None) -> bool:
        """Whether a clustered mix of n decode rows writes its int8 form (``emit_xq``): int8
        products read it, a block's mix (the head's, without inject, feeds a norm), the default
        cluster tuning (an override keeps its own kernels) and columns CLUSTER_XQ_TUNING's
        CTAs tile in whole groups of 32."""
        return (
            self.emit_xq
            and inject is not None
            and self.cluster_tuning == CLUSTER_TUNING
            and self.linear.fused_xq(n, d)
            and CLUSTER_XQ_TUNING.writes_xq(nt, d)
        )

    # -- ops --

    def mix(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        down: QuantWeight,
        up: QuantWeight,
        inject: QuantWeight | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode rows take the fused kernels (weights read once per group of 8 tokens); prompt
        rows GEMMs that read each weight once for the chunk (``linear.path`` decides:
        rowpath.py): down and inject in one where they stack (``stack_inject``), then up."""
        if x.dim() == 3 and not self.linear.path.decode_kernels(x.shape[0]):
            return hc_prompt.mix(self, x, norm, down, up, inject, eps)
        _, mixed, inj = self._run(x, None, None, norm, down, up, inject, eps)
        return mixed, inj

    def combine_mix(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        inject_prev: torch.Tensor,
        norm: torch.Tensor,
        down: QuantWeight,
        up: QuantWeight,
        inject: QuantWeight | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        check_combine(x, out, inject_prev)
        if x.dim() == 3 and not self.linear.path.decode_kernels(x.shape[0]):  # prompt rows
            return hc_prompt.combine_mix(self, x, out, inject_prev, norm, down, up, inject, eps)
        fused, mixed, inj = self._run(x, out, inject_prev, norm, down, up, inject, eps)
        assert fused is not None  # given out, _run always combines
        return fused, mixed, inj

    def gate_mix(self, u: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        return hc_prompt.gate_mix(self, u, xn)

    def combine(self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        check_combine(x, out, inject)
        return hc_prompt.combine(self, x, out, inject)

    def _run(
        self,
        x: torch.Tensor,
        out_prev: torch.Tensor | None,
        inj_prev: torch.Tensor | None,
        norm: torch.Tensor,
        down: QuantWeight,
        up: QuantWeight,
        inject: QuantWeight | None,
        eps: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(new x when fused else None, mixed, inject): hc_down (once, or twice when down and
        inject differ in format), then hc_up."""
        n, hc, d, r = check_mix(x, norm, down, up, inject)
        if not self.kernels_apply(hc, d, r, (down, up, inject)) or n == 0:
            if out_prev is None:
                return (None, *self.fallback.mix(x, norm, down, up, inject, eps))
            assert inj_prev is not None
            return self.fallback.combine_mix(x, out_prev, inj_prev, norm, down, up, inject, eps)
        for w in (down, up, inject):
            if w is not None:
                check_weight(w, self.device)
        x = vec4_input("x", x, self.device)
        norm = vec4_input("norm", norm, self.device)
        x_new = None
        if out_prev is not None:
            assert inj_prev is not None
            out_prev = vec4_input("out", out_prev, self.device)
            inj_prev = vec4_input("inject", inj_prev, self.device)
            x_new = torch.empty_like(x)
        tune = self.tuning
        nt = token_group(n)  # one pass of up to 8 tokens (groups of 1, 2 or 4 were slower)
        pieces = cluster_pieces(hc, d) if self.cluster and self.kernels.clusters else None
        if pieces is not None:  # hc_downc + hc_upl (hc_cluster.py)
            streams = (x, out_prev, inj_prev, x_new)
            weights = (down, up, inject)
            tune, xq = self.cluster_tuning, None
            if self._emits_xq(n, d, nt, inject):
                tune, xq = CLUSTER_XQ_TUNING, self.linear.q8.empty(n, d)
            tune = tune if self.stage_hoist else replace(tune, stage_hoist=False)
            mixed, inj = mix_clustered(
                self.kernels, tune, self.branch, pieces, streams, norm, weights, nt, eps, xq
            )
            if xq is not None:
                self.linear.q8.offer(mixed, xq)
            return x_new, mixed, inj
        groups = (n + nt - 1) // nt
        part = down_part(d, nt)
        assert part is not None  # hc_kernels_apply checked the largest group
        n_inj = hc if inject is not None else 0
        p_stride = r + n_inj
        dev = self.device
        partial = torch.empty(hc, n, p_stride, dtype=torch.float32, device=dev)  # P
        sumsq = torch.empty(hc, n, dtype=torch.float32, device=dev)  # SS
        mixed = torch.empty(n, d, dtype=torch.float32, device=dev)
        inj = torch.empty(n, hc, dtype=torch.float32, device=dev) if inject is not None else None

        per_cta = tune.down_rows_per_cta(nt)

        def down_launch(wa: QuantWeight, wb: QuantWeight | None, col0: int, aux: int) -> None:
            rows = wa.rows + (wb.rows if wb is not None else 0)
            self.kernels.launch(
                self.kernels.kernel(
                    HC_SOURCE, f"hc_down_{wa.type_name}_t{nt}", tune.defines(wa.type_name)
                ),
                (((rows + per_cta - 1) // per_cta) * hc, groups),
                32 * tune.down_warps,
                *stream_args(x, norm, (out_prev, inj_prev, x_new), wa, wb),
                partial.data_ptr(),
                sumsq.data_ptr(),
                np.int32(n),
                np.int32(hc),
                np.int32(d),
                np.int32(part),
                np.int32(p_stride),
                np.int32(col0),
                np.int32(aux),
                shmem=nt * part * 4,
            )

        down_and_inject(self.branch, down, inject, down_launch, down.rows)

        per_cta = tune.up_cols_per_cta(nt)
        self.kernels.launch(
            self.kernels.kernel(
                HC_SOURCE, f"hc_up_{up.type_name}_t{nt}", tune.defines(up.type_name)
            ),
            ((d + per_cta - 1) // per_cta, groups),
            32 * tune.up_warps,
            up.data.data_ptr(),
            partial.data_ptr(),
            sumsq.data_ptr(),
            (x_new if x_new is not None else x).data_ptr(),
            norm.data_ptr(),
            mixed.data_ptr(),
            inj.data_ptr() if inj is not None else 0,
            np.int32(n),
            np.int32(hc),
            np.int32(d),
            np.int32(r),
            np.int32(p_stride),
            np.float32(eps),
            shmem=up_smem(nt, r, hc),
        )
        return x_new, mixed, inj
