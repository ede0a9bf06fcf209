"""The hc family: hyper-connections (qwen4exp), the mix that reads the residual streams and
the combine that writes a block's output back into them (reference:
``mgserve.core.reference.hyper_connections``).

For streams x [N, hc, d] and one HC weight set (norm [hc, d] f32; down [r, hc*d], up [hc*d, r],
inject [hc, hc*d] as QuantWeight)::

    xn     = rms_norm(x, per stream) * norm                       # [N, hc, d]
    low    = silu(down . flat(xn) / hc)                            # [N, r]
    mixed  = mean_s(sigmoid(up . low) * xn)                        # [N, d]: what the block reads
    inject = 2 * sigmoid(inject . flat(xn) / hc)                   # [N, hc] (None for the head)
    x      = x + inject[:, :, None] * out[:, None, :]              # combine

``HCTorch`` is the reference's ``hyper_connections.mix_with`` / ``combine`` on dequantized weights:
bitwise the reference on the CPU. ``HCCuda`` (hc_cuda.py) runs kernels/hc.cu: two kernels per mix
(``hc_down``: the down and inject products by stream, with the norm's sums of squares; ``hc_up``:
the up product fused with its sigmoid, the product with xn and the mean over streams), and one per
combine. ``combine_mix`` also folds the combine into the next mix's first kernel (one kernel and
one pass over x fewer). Every shape is static and nothing waits for the host, so decode captures
into a CUDA graph; a token's results do not depend on the other tokens of the batch (bitwise), for
any N. Weights of every format the matvecs read run on the kernels (BF16 / F16 / F32 / Q8_0 through
split load-then-decode readers, the rest, e.g. a Q4_K file's Q4_K / Q6_K down and Q5_0 up, through
their gguf_blocks decoders); shapes the kernels cannot stage fall back to the torch version on
dequantized weights. Prompt rows (``linear.path``, ops/rowpath.py: a prompt step, or more than 8
tokens outside a runner step) take ``mix_with`` on the backend's own GEMMs and norm kernel instead,
which read each weight once for the whole chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.core.reference import hyper_connections
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops.linear import rows_linear
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.ops.branch import Branches

HC_SOURCE = "hc.cu"
TOKEN_GROUPS = (1, 2, 4, 8)  # NT instances of the kernels: tokens sharing one pass over weights
MAX_TOKEN_GROUP = TOKEN_GROUPS[-1]  # more tokens: several groups (grid y), same per-token math
DYNAMIC_SMEM = 46 * 1024  # shared memory a kernel may stage (48 KB without an opt-in, less static)
PART_ALIGN = 256  # a split stream's parts are multiples of this (see down_part)
COMBINE_THREADS = 256


@dataclass(frozen=True)
class HCTuning:
    """Compile-time shape of kernels/hc.cu (its -D macros). The 4-tuples hold one value per
    token group (1, 2, 4, 8 tokens: TOKEN_GROUPS), each 1..15 (hc.cu packs them as hex digits).
    Per-token arithmetic never depends on them, so a tuning keeps batch invariance."""

    down_warps: int = 8  # warps per hc_down CTA
    down_rows: tuple[int, int, int, int] = (1, 1, 1, 2)  # rows of [down | inject] per warp
    down_batch: tuple[int, int, int, int] = (10, 10, 5, 5)  # weight loads in flight per lane+row
    # 8 warps of 2 columns: 13.8 / 34.2 us a mix at 1 / 8 tokens against 15.1 / 39.7 for 4 warps
    # of (2, 2, 4, 4) (H100, test_hc.py's timing sweep, 2026-12-06)
    up_warps: int = 8  # warps per hc_up CTA
    up_cols: tuple[int, int, int, int] = (2, 2, 2, 2)  # output columns per warp of hc_up
    up_batch: tuple[int, int, int, int] = (5, 5, 5, 3)  # loads in flight per lane and column
    prefetch: bool = True  # L2 prefetch of each CTA's weights before its prologue
    split_blocks: bool = True  # Q4_K / Q5_0 / Q6_K through gguf_split.cuh's raw-bits readers
    inv_once: bool = True  # hc_up's norm scales once per CTA, not wherever read (same bits)
    xq: bool = False  # the clustered module's up kernel also writes the int8 form (hc_uplq)
    # the clustered mix stages its inputs from loads issued together, not each token's (or
    # stride's) in its own branch, one L2 round trip each: hc_downc at 8 tokens 4 tokens at a
    # time, hc_upl 8 strides of low. The same bits; five sessions' decode +1.4% / +1.6% on the
    # H100 (2026-12-07, bench model --paired 5 --toggle hc.stage_hoist), one session even
    stage_hoist: bool = True

    def __post_init__(self) -> None:
        for name in ("down_warps", "up_warps"):
            if not 1 <= getattr(self, name) <= 16:
                raise ValueError(f"HCTuning.{name} must be in 1..16, got {getattr(self, name)}")
        for name in ("down_rows", "down_batch", "up_cols", "up_batch"):
            v = getattr(self, name)
            if len(v) != len(TOKEN_GROUPS) or not all(1 <= x <= 15 for x in v):
                raise ValueError(f"HCTuning.{name} must be 4 values in 1..15, got {v}")

    def defines(self, type_name: str, clustered: bool = False) -> tuple[tuple[str, str], ...]:
        """The -D macros of the hc.cu module for weights of ``type_name``: its hc_down / hc_up
        and combine kernels, or ``clustered`` its hc_downc / hc_upl (hc_cluster.py; with
        ``xq``, hc_uplq)."""

        def packed(v: tuple[int, ...]) -> str:
            return "0x" + "".join(f"{x:X}" for x in v)

        return (
            (
                ("HC_TYPE", type_name),
                ("DOWN_WARPS", str(self.down_warps)),
                ("DOWN_ROWS", packed(self.down_rows)),
                ("DOWN_BATCH", packed(self.down_batch)),
                ("UP_WARPS", str(self.up_warps)),
                ("UP_COLS", packed(self.up_cols)),
                ("UP_BATCH", packed(self.up_batch)),
                ("PREFETCH", str(int(self.prefetch))),
                ("SPLIT_BLOCKS", str(int(self.split_blocks))),
                ("INV_ONCE", str(int(self.inv_once))),
            )
            + ((("HC_CLUSTERED", "1"),) if clustered else ())
            + ((("HC_XQ", "1"),) if self.xq else ())
            + (() if self.stage_hoist else (("STAGE_HOIST", "0"),))
        )

    def down_rows_per_cta(self, nt: int) -> int:
        return self.down_warps * self.down_rows[TOKEN_GROUPS.index(nt)]

    def up_cols_per_cta(self, nt: int) -> int:
        return self.up_warps * self.up_cols[TOKEN_GROUPS.index(nt)]

    def writes_xq(self, nt: int, d: int) -> bool:
        """Whether hc_upl can round its outputs [nt, d] to int8 groups itself: its CTAs' columns
        are whole groups of 32 and tile d (kernels/hc.cu's hc_up)."""
        per_cta = self.up_cols_per_cta(nt)
        return per_cta % 32 == 0 and d % per_cta == 0


# The clustered mix's shape (HCCuda.cluster_tuning; its own hc.cu module): a lane there has 5
# runs of a 1280-value slice (qwen4exp), and hc_upl no sums in its prologue. At qwen4exp's
# shape, Q4_K_M formats, on the H100 (test_hc.py's sweep, 2026-12-06 14:25): 14.2 / 26.5 us a
# mix at 1 / 8 tokens against 18.5 / 26.5 with HCTuning()'s loads in flight.
CLUSTER_TUNING = HCTuning(down_batch=(5, 5, 5, 5), up_batch=(3, 3, 3, 3))
# The clustered mix that also writes what it mixes rounded to int8 (``HCCuda.emit_xq``): hc_upl's
# CTAs of 16 warps of 2 columns, 32 columns a CTA, so each CTA rounds whole groups of 32 itself.
CLUSTER_XQ_TUNING = dataclasses.replace(CLUSTER_TUNING, up_warps=16, xq=True)


def stream_args(
    x: torch.Tensor,
    norm: torch.Tensor,
    prev: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    wa: QuantWeight,
    wb: QuantWeight | None,
) -> tuple[object, ...]:
    """hc_down's and hc_downc's first arguments: x, gamma, out_prev, inj_prev, x_new (the last
    three ``prev``, 0 where None), then the rows of [wa | wb] (wb absent: 0 rows)."""
    ptrs = tuple(t.data_ptr() if t is not None else 0 for t in prev)
    rows_b = np.int32(wb.rows if wb is not None else 0)
    wb_ptr = wb.data.data_ptr() if wb is not None else 0
    return (x.data_ptr(), norm.data_ptr(), *ptrs, wa.data.data_ptr(), np.int32(wa.rows), wb_ptr,
            rows_b)  # fmt: skip


def down_and_inject(
    branch: Branches,
    down: QuantWeight,
    inject: QuantWeight | None,
    launch: Callable[[QuantWeight, QuantWeight | None, int, int], None],
    inject_col: int,
) -> None:
    """``launch(wa, wb, col0, aux)`` for [down | inject] in one launch when they share a format,
    else the inject's alone (its own output columns from ``inject_col``; no aux work) on a side
    stream in decode (branch.py) beside the down's."""
    if inject is None or inject.type_name == down.type_name:
        launch(down, inject, 0, 1)
        return
    side = branch.fork()
    with side:
        launch(inject, None, inject_col, 0)
    launch(down, None, 0, 1)
    side.join()


def token_group(n: int) -> int:
    """Tokens per kernel pass for a batch of n: the smallest instance holding min(n, 8)."""
    m = min(max(n, 1), MAX_TOKEN_GROUP)
    return next(g for g in TOKEN_GROUPS if g >= m)


def down_part(d: int, nt: int, smem: int = DYNAMIC_SMEM) -> int | None:
    """Values of one stream that hc_down stages in shared memory at a time for nt tokens: all d
    when nt * d floats fit, else the largest part that fits and is a multiple of PART_ALIGN (then
    each lane still visits its runs in the same order as with one part: batch invariance). None
    when there is none (the torch version runs)."""
    if nt * d * 4 <= smem:
        return d
    for parts in range(2, d // PART_ALIGN + 1):
        part = d // parts
        if d % parts == 0 and part % PART_ALIGN == 0 and nt * part * 4 <= smem:
            return part
    return None


def up_smem(nt: int, r: int, hc: int) -> int:
    """Bytes of hc_up's shared memory: low [nt, r], then the norm scales [nt, hc]."""
    return nt * (r + hc) * 4


def check_mix(
    x: torch.Tensor,
    norm: torch.Tensor,
    down: QuantWeight,
    up: QuantWeight,
    inject: QuantWeight | None,
) -> tuple[int, int, int, int]:
    """(N, hc, d, r) of a mix; ValueError on any shape or dtype that does not fit."""
    if x.dim() != 3:
        raise ValueError(f"hc.mix: x has shape {list(x.shape)}, expected [N, hc, d]")
    if x.dtype != torch.float32 or norm.dtype != torch.float32:
        raise ValueError(f"hc.mix: x and norm must be float32, got {x.dtype} and {norm.dtype}")
    n, hc, d = x.shape
    if tuple(norm.shape) != (hc, d):
        raise ValueError(f"hc.mix: norm has shape {list(norm.shape)}, expected [{hc}, {d}]")
    r = down.rows
    if down.k != hc * d:
        raise ValueError(f"{down.name}: rows of {down.k} values, expected hc * d = {hc * d}")
    if up.rows != hc * d or up.k != r:
        raise ValueError(f"{up.name}: [{up.rows}, {up.k}], expected [hc * d, r] = [{hc * d}, {r}]")
    if inject is not None and (inject.rows != hc or inject.k != hc * d):
        raise ValueError(
            f"{inject.name}: [{inject.rows}, {inject.k}], expected [hc, hc * d] = [{hc}, {hc * d}]"
        )
    return n, hc, d, r


def check_combine(x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"hc.combine: x has shape {list(x.shape)}, expected [N, hc, d]")
    n, hc, d = x.shape
    if tuple(out.shape) != (n, d):
        raise ValueError(f"hc.combine: out has shape {list(out.shape)}, expected [{n}, {d}]")
    if tuple(inject.shape) != (n, hc):
        raise ValueError(f"hc.combine: inject has shape {list(inject.shape)}, expected [{n}, {hc}]")
    for name, t in (("x", x), ("out", out), ("inject", inject)):
        if t.dtype != torch.float32:
            raise ValueError(f"hc.combine: {name} must be float32, got {t.dtype}")


class HCTorch:
    """The hyper-connection mix and combine in plain PyTorch on dequantized (cached) weights."""

    def __init__(self, dense: DenseWeights) -> None:
        self.dense = dense

    def mix(
        self,
        x: torch.Tensor,  # [N, hc, d] f32 residual streams
        norm: torch.Tensor,  # [hc, d] f32 per-stream RMSNorm weights
        down: QuantWeight,  # [r, hc * d]
        up: QuantWeight,  # [hc * d, r]
        inject: QuantWeight | None,  # [hc, hc * d], None for the head's mix
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # mixed [N, d], inject [N, hc] or None
        """What a block reads from the streams, and how strongly it writes back
        (``hyper_connections.mix`` on the dequantized weights)."""
        check_mix(x, norm, down, up, inject)
        down_p = partial(rows_linear, w=self.dense(down))
        up_p = partial(rows_linear, w=self.dense(up))
        inj = None if inject is None else partial(rows_linear, w=self.dense(inject))
        return hyper_connections.mix_with(x, norm, eps, down_p, up_p, inj)

    def combine(self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """x [N, hc, d] + inject [N, hc] x out [N, d] broadcast over the streams -> a new
        [N, hc, d] (``hyper_connections.combine``)."""
        check_combine(x, out, inject)
        return hyper_connections.combine(x, out, inject)

    def combine_mix(
        self,
        x: torch.Tensor,  # [N, hc, d] streams before the combine
        out: torch.Tensor,  # [N, d] the previous block's output
        inject_prev: torch.Tensor,  # [N, hc] the previous mix's inject
        norm: torch.Tensor,
        down: QuantWeight,
        up: QuantWeight,
        inject: QuantWeight | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # new x, mixed, inject
        """combine then mix of the new streams (one pass fewer on the GPU)."""
        x_new = self.combine(x, out, inject_prev)
        mixed, inj = self.mix(x_new, norm, down, up, inject, eps)
        return x_new, mixed, inj
