"""Hyper-connections (qwen4exp) on the device backend: the mix that reads the residual streams and
the combine that writes a block's output back into them (reference:
``mgserve.core.reference.hyper_connections``).

For streams x [N, hc, d] and one HC weight set (norm [hc, d] f32; down [r, hc*d], up [hc*d, r],
inject [hc, hc*d] as QuantWeight)::

    xn     = rms_norm(x, per stream) * norm                       # [N, hc, d]
    low    = silu(down . flat(xn) / hc)                            # [N, r]
    mixed  = mean_s(sigmoid(up . low) * xn)                        # [N, d]: what the block reads
    inject = 2 * sigmoid(inject . flat(xn) / hc)                   # [N, hc] (None for the head)
    x      = x + inject[:, :, None] * out[:, None, :]              # combine

``HCTorch`` is that, op for op, with the reference's functions: bitwise the reference on the CPU.
``HCCuda`` runs kernels/hc.cu: two kernels per mix (``hc_down``: the down and inject products by
stream, with the norm's sums of squares; ``hc_up``: the up product fused with its sigmoid, the
product with xn and the mean over streams), and one per combine. ``hc_combine_mix`` also folds
the combine into the next mix's first kernel (one kernel and one pass over x fewer). Every shape
is static and nothing waits for the host, so decode captures into a CUDA graph; a token's results
do not depend on the other tokens of the batch (bitwise), for any N. BF16, F16, F32 and Q8_0
weights run on the kernels; other formats (or shapes the kernels cannot stage) fall back to the
torch version on dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mgserve.core.reference import ops as ref_ops
from mgserve.core.reference import rowwise
from mgserve.cuda.kbase import CudaBase, TorchBase, check_cuda, check_weight
from mgserve.cuda.weights import QuantWeight

HC_SOURCE = "hc.cu"
HC_KERNEL_TYPES = ("BF16", "F16", "F32", "Q8_0")  # weight formats hc.cu reads
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
    up_warps: int = 4  # warps per hc_up CTA
    up_cols: tuple[int, int, int, int] = (2, 2, 4, 4)  # output columns per warp of hc_up
    up_batch: tuple[int, int, int, int] = (5, 5, 5, 3)  # loads in flight per lane and column
    prefetch: bool = True  # L2 prefetch of each CTA's weights before its prologue

    def __post_init__(self) -> None:
        for name in ("down_warps", "up_warps"):
            if not 1 <= getattr(self, name) <= 16:
                raise ValueError(f"HCTuning.{name} must be in 1..16, got {getattr(self, name)}")
        for name in ("down_rows", "down_batch", "up_cols", "up_batch"):
            v = getattr(self, name)
            if len(v) != len(TOKEN_GROUPS) or not all(1 <= x <= 15 for x in v):
                raise ValueError(f"HCTuning.{name} must be 4 values in 1..15, got {v}")

    def defines(self, type_name: str) -> tuple[tuple[str, str], ...]:
        """The -D macros of the hc.cu module for weights of ``type_name``."""

        def packed(v: tuple[int, ...]) -> str:
            return "0x" + "".join(f"{x:X}" for x in v)

        return (
            ("HC_TYPE", type_name),
            ("DOWN_WARPS", str(self.down_warps)),
            ("DOWN_ROWS", packed(self.down_rows)),
            ("DOWN_BATCH", packed(self.down_batch)),
            ("UP_WARPS", str(self.up_warps)),
            ("UP_COLS", packed(self.up_cols)),
            ("UP_BATCH", packed(self.up_batch)),
            ("PREFETCH", str(int(self.prefetch))),
        )

    def down_rows_per_cta(self, nt: int) -> int:
        return self.down_warps * self.down_rows[TOKEN_GROUPS.index(nt)]

    def up_cols_per_cta(self, nt: int) -> int:
        return self.up_warps * self.up_cols[TOKEN_GROUPS.index(nt)]


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


def up_smem(nt: int, r: int) -> int:
    """Bytes of hc_up's shared memory: low [nt, r]."""
    return nt * r * 4


def _check_mix(
    x: torch.Tensor,
    norm: torch.Tensor,
    down: QuantWeight,
    up: QuantWeight,
    inject: QuantWeight | None,
) -> tuple[int, int, int, int]:
    """(N, hc, d, r) of a mix; ValueError on any shape or dtype that does not fit."""
    if x.dim() != 3:
        raise ValueError(f"hc_mix: x has shape {list(x.shape)}, expected [N, hc, d]")
    if x.dtype != torch.float32 or norm.dtype != torch.float32:
        raise ValueError(f"hc_mix: x and norm must be float32, got {x.dtype} and {norm.dtype}")
    n, hc, d = x.shape
    if tuple(norm.shape) != (hc, d):
        raise ValueError(f"hc_mix: norm has shape {list(norm.shape)}, expected [{hc}, {d}]")
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


def _check_combine(x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"hc_combine: x has shape {list(x.shape)}, expected [N, hc, d]")
    n, hc, d = x.shape
    if tuple(out.shape) != (n, d):
        raise ValueError(f"hc_combine: out has shape {list(out.shape)}, expected [{n}, {d}]")
    if tuple(inject.shape) != (n, hc):
        raise ValueError(f"hc_combine: inject has shape {list(inject.shape)}, expected [{n}, {hc}]")
    for name, t in (("x", x), ("out", out), ("inject", inject)):
        if t.dtype != torch.float32:
            raise ValueError(f"hc_combine: {name} must be float32, got {t.dtype}")


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, k] @ w [m, k]^T: the reference's row-blocked ``ops.linear`` on the CPU (each row's
    result independent of N, bitwise the reference), one product elsewhere."""
    if x.device.type == "cpu":
        return ref_ops.linear(x, w)
    return x @ w.T


class HCTorch(TorchBase):
    """The hyper-connection mix and combine in plain PyTorch on dequantized (cached) weights."""

    def hc_mix(
        self,
        x: torch.Tensor,  # [N, hc, d] f32 residual streams
        norm: torch.Tensor,  # [hc, d] f32 per-stream RMSNorm weights
        down: QuantWeight,  # [r, hc * d]
        up: QuantWeight,  # [hc * d, r]
        inject: QuantWeight | None,  # [hc, hc * d], None for the head's mix
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # mixed [N, d], inject [N, hc] or None
        """What a block reads from the streams, and how strongly it writes back
        (``hyper_connections.mix``)."""
        n, hc, d, _ = _check_mix(x, norm, down, up, inject)
        xn = ref_ops.rms_norm(x, norm, eps).reshape(n, hc * d)  # [N, hc * d]
        low = rowwise.silu(_linear(xn, self.dense(down)) / hc)  # [N, r]
        gate = rowwise.sigmoid(_linear(low, self.dense(up)))  # [N, hc * d]
        mixed = (gate * xn).view(n, hc, d).mean(dim=1)  # [N, d]
        if inject is None:
            return mixed, None
        return mixed, 2.0 * rowwise.sigmoid(_linear(xn, self.dense(inject)) / hc)

    def hc_combine(self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """x [N, hc, d] + inject [N, hc] x out [N, d] broadcast over the streams -> a new
        [N, hc, d] (``hyper_connections.combine``)."""
        _check_combine(x, out, inject)
        return x + inject[:, :, None] * out[:, None, :]

    def hc_combine_mix(
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
        """hc_combine then hc_mix of the new streams (one pass fewer on the GPU)."""
        x_new = self.hc_combine(x, out, inject_prev)
        mixed, inj = self.hc_mix(x_new, norm, down, up, inject, eps)
        return x_new, mixed, inj


class HCCuda(CudaBase, HCTorch):
    """The mix and combine on kernels/hc.cu (see the module docstring). Activations must be
    float32 on this device; weights in a format of HC_KERNEL_TYPES run on the kernels, others on
    the torch version. ``hc_tuning`` sets the kernels' compile-time shape."""

    hc_tuning: HCTuning = HCTuning()

    # -- helpers --

    def _hc_act(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t as the kernels read it: contiguous, 16-byte aligned (a copy only when it is not),
        float32 on this device (else ValueError)."""
        if not t.is_contiguous() or t.data_ptr() % 16:
            t = t.clone(memory_format=torch.contiguous_format)
        check_cuda(name, t, self.device, torch.float32)
        return t

    def _hc_weight(self, w: QuantWeight) -> None:
        check_weight(w, self.device)

    @staticmethod
    def hc_kernels_apply(hc: int, d: int, r: int, weights: tuple[QuantWeight | None, ...]) -> bool:
        """Whether the kernels run a mix of these shapes and weights. Depends on shapes and
        formats only, never on N, so a token's results never depend on the batch."""
        if any(w is not None and w.type_name not in HC_KERNEL_TYPES for w in weights):
            return False
        if d % 8 or r % 8 or d <= 0 or r <= 0:
            return False
        return (
            down_part(d, MAX_TOKEN_GROUP) is not None
            and up_smem(MAX_TOKEN_GROUP, r) <= DYNAMIC_SMEM
        )

    # -- ops --

    def hc_mix(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        down: QuantWeight,
        up: QuantWeight,
        inject: QuantWeight | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, mixed, inj = self._hc_run(x, None, None, norm, down, up, inject, eps)
        return mixed, inj

    def hc_combine_mix(
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
        _check_combine(x, out, inject_prev)
        x_new, mixed, inj = self._hc_run(x, out, inject_prev, norm, down, up, inject, eps)
        assert x_new is not None  # given out, _hc_run always combines
        return x_new, mixed, inj

    def hc_combine(self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        _check_combine(x, out, inject)
        n, hc, d = x.shape
        if d % 4 or n == 0:  # the kernel reads float4 runs of each stream
            return HCTorch.hc_combine(self, x, out, inject)
        x, out, inject = (
            self._hc_act(k, t) for k, t in (("x", x), ("out", out), ("inject", inject))
        )
        y = torch.empty_like(x)
        n4 = n * hc * d // 4
        self.launch(
            self.kernel(HC_SOURCE, "hc_combine", self.hc_tuning.defines("BF16")),
            (n4 + COMBINE_THREADS - 1) // COMBINE_THREADS,
            COMBINE_THREADS,
            x.data_ptr(),
            out.data_ptr(),
            inject.data_ptr(),
            y.data_ptr(),
            np.int32(hc),
            np.int32(d // 4),
            np.int64(n4),
        )
        return y

    def _hc_run(
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
        n, hc, d, r = _check_mix(x, norm, down, up, inject)
        if not self.hc_kernels_apply(hc, d, r, (down, up, inject)) or n == 0:
            if out_prev is None:
                return (None, *HCTorch.hc_mix(self, x, norm, down, up, inject, eps))
            assert inj_prev is not None
            return HCTorch.hc_combine_mix(self, x, out_prev, inj_prev, norm, down, up, inject, eps)
        for w in (down, up, inject):
            if w is not None:
                self._hc_weight(w)
        x = self._hc_act("x", x)
        norm = self._hc_act("norm", norm)
        x_new = None
        if out_prev is not None:
            assert inj_prev is not None
            out_prev, inj_prev = self._hc_act("out", out_prev), self._hc_act("inject", inj_prev)
            x_new = torch.empty_like(x)
        tune = self.hc_tuning
        nt = token_group(n)
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

        # [down | inject] in one launch when they share a format, else one launch each
        if inject is None or inject.type_name == down.type_name:
            launches: list[tuple[QuantWeight, QuantWeight | None]] = [(down, inject)]
        else:
            launches = [(down, None), (inject, None)]
        col0, aux = 0, 1
        per_cta = tune.down_rows_per_cta(nt)
        for wa, wb in launches:
            rows = wa.rows + (wb.rows if wb is not None else 0)
            self.launch(
                self.kernel(HC_SOURCE, f"hc_down_{wa.type_name}_t{nt}", tune.defines(wa.type_name)),
                (((rows + per_cta - 1) // per_cta) * hc, groups),
                32 * tune.down_warps,
                x.data_ptr(),
                norm.data_ptr(),
                out_prev.data_ptr() if out_prev is not None else 0,
                inj_prev.data_ptr() if inj_prev is not None else 0,
                x_new.data_ptr() if x_new is not None else 0,
                wa.data.data_ptr(),
                np.int32(wa.rows),
                wb.data.data_ptr() if wb is not None else 0,
                np.int32(wb.rows if wb is not None else 0),
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
            col0, aux = col0 + rows, 0

        per_cta = tune.up_cols_per_cta(nt)
        self.launch(
            self.kernel(HC_SOURCE, f"hc_up_{up.type_name}_t{nt}", tune.defines(up.type_name)),
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
            shmem=up_smem(nt, r),
        )
        return x_new, mixed, inj
