"""``HGemm``: the prompt GEMM on f16 operands (kernels/hgemm.cu: a cp.async ring for both
operands, ldmatrix on swizzled tiles, mma.sync m16n8k16 with f32 accumulators; on sm_90 with
``wgmma``, kernels/hgemm_wgmma.cu: the same ring feeding warpgroup MMA from shared memory).

``LinearCuda`` runs it for prompt chunks of at least ``HGemmTuning.min_rows`` rows: W is
dequantized once into the f16 scratch by ``QGemm.dequantize`` (the bits qgemm.cu's CTAs decode
into their tiles) and multiplied here, instead of every CTA row of qgemm.cu decoding W again.
Both compute each output as the same ascending chain of k16 products from 0, so a token's row is
bitwise the same on either path, for any M and any tuning of either (the choice of path by M
keeps batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mgserve.cuda.checks import check_vec4, tuning_ints
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.qgemm import check_tiles
from mgserve.cuda.ops.wgmma import HGEMM_WG_SOURCE, MAX_SMEM, WgmmaTuning

HGEMM_SOURCE = "hgemm.cu"
# hgemm_wgmma.cu's tiles for outputs of at most NARROW_N columns: 128-column tiles, twice the
# CTAs of the 256-column default for the SMs (H100 at M = 4096: 2560 x 2560 0.112 ms against
# 0.118, 2560 x 10240 0.428 against 0.443; 10240 x 2560 0.433 against 0.395, so not there)
NARROW_N = 4096
NARROW_TUNING = WgmmaTuning(128, 128, 5)


@dataclass(frozen=True)
class HGemmTuning:
    """Compile-time tile shape of kernels/hgemm.cu (its HG_* -D macros) and the prompt size from
    which ``LinearCuda`` takes this path. Results never depend on it (bitwise); only speed does."""

    bm: int = 128  # output rows (tokens) per CTA
    bn: int = 256  # output columns (W rows) per CTA
    bk: int = 32  # k per pipeline step
    stages: int = 4  # shared buffers in the cp.async ring
    warps_m: int = 2  # warps along M; a warp owns a (bm / warps_m) x (bn / warps_n) tile
    warps_n: int = 4  # warps along N
    min_ctas: int = 1  # CTAs per SM the registers are capped for (__launch_bounds__)
    group_m: int = 8  # tile rows per group of the CTA order (L2 reuse)
    min_rows: int = 256  # prompt rows from which W is dequantized once (else qgemm.cu)

    def __post_init__(self) -> None:
        check_tiles(self, self.bm, self.bn, self.bk, self.warps_m, self.warps_n)
        if not 2 <= self.stages <= 8:
            raise ValueError(f"HGemmTuning.stages must be in 2..8, got {self.stages}")
        if self.smem_bytes > MAX_SMEM:
            raise ValueError(f"HGemmTuning: {self.smem_bytes} bytes of shared memory > 227 KB")
        if not 1 <= self.min_ctas <= 4 or self.group_m < 1 or self.min_rows < 1:
            raise ValueError(
                f"HGemmTuning: min_ctas {self.min_ctas} (1..4), group_m {self.group_m} and "
                f"min_rows {self.min_rows} (>= 1)"
            )

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def smem_bytes(self) -> int:
        """The ring: ``stages`` f16 buffers of the X and W tiles (dynamic shared memory)."""
        return self.stages * (self.bm + self.bn) * self.bk * 2

    @classmethod
    def parse(cls, text: str) -> HGemmTuning:
        """ "BM,BN,BK,STAGES,WARPS_M,WARPS_N[,MIN_CTAS[,GROUP_M[,MIN_ROWS]]]" as a bench flag."""
        fields = "BM,BN,BK,STAGES,WARPS_M,WARPS_N[,MIN_CTAS[,GROUP_M[,MIN_ROWS]]]"
        return cls(*tuning_ints(text, "hgemm", fields))

    def defines(self) -> tuple[tuple[str, str], ...]:
        return (
            ("HG_BM", str(self.bm)),
            ("HG_BN", str(self.bn)),
            ("HG_BK", str(self.bk)),
            ("HG_STAGES", str(self.stages)),
            ("HG_WARPS_M", str(self.warps_m)),
            ("HG_WARPS_N", str(self.warps_n)),
            ("HG_MIN_CTAS", str(self.min_ctas)),
            ("HG_GROUP_M", str(self.group_m)),
        )


class HGemm:
    """The hgemm.cu launch, or hgemm_wgmma.cu's where ``wgmma`` is on (module docstring): by
    default where the GPU has warpgroup MMA (``Kernels.wgmma``: sm_90). The two give the same
    bits (tests/cuda/test_hgemm_wgmma.py); on the H100 wgmma is 1.8-2.2x faster at qwen4exp's
    shapes and a 4096-token prompt 13.6% faster (BENCHMARKS.md, 2026-12-06 17:10)."""

    def __init__(
        self,
        kernels: Kernels,
        tuning: HGemmTuning | None = None,
        wgmma_tuning: WgmmaTuning | None = None,
        wgmma: bool | None = None,
    ) -> None:
        self.kernels = kernels
        self.device = kernels.device
        self.tuning = tuning or HGemmTuning()
        self.wgmma_tuning = wgmma_tuning or WgmmaTuning()
        self.wgmma = kernels.wgmma if wgmma is None else wgmma

    def wgmma_tiles(self, n: int) -> WgmmaTuning:
        """hgemm_wgmma.cu's tiles for n output columns: ``wgmma_tuning``, or NARROW_TUNING for at
        most NARROW_N columns while ``wgmma_tuning`` is the default."""
        if n <= NARROW_N and self.wgmma_tuning == WgmmaTuning():
            return NARROW_TUNING
        return self.wgmma_tuning

    def matmul(self, x16: torch.Tensor, w16: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [M, n] fp32 = x16 [M, k] @ w16 [n, k]^T, on the current stream. x16 and w16:
        contiguous f16 with 16-byte aligned rows (k a multiple of 8); ``out`` may be a column
        slice of a wider matrix (unit column stride)."""
        m, k = x16.shape
        n = w16.shape[0]
        check_vec4("x16", x16, self.device, torch.float16)
        check_vec4("w16", w16, self.device, torch.float16)
        if out.device != self.device or out.dtype != torch.float32:
            raise ValueError(f"hgemm: out is {out.dtype} on {out.device}, expected fp32 on the GPU")
        if k % 8 or w16.shape[1] != k or tuple(out.shape) != (m, n) or out.stride(1) != 1:
            raise ValueError(
                f"hgemm: x16 {list(x16.shape)}, w16 {list(w16.shape)}, out {list(out.shape)} "
                f"(strides {out.stride()}): expected [M, k], [n, k], [M, n] with unit columns, "
                "k % 8 == 0"
            )
        if m == 0 or n == 0:
            return out
        t: HGemmTuning | WgmmaTuning
        if self.wgmma:
            t = self.wgmma_tiles(n)
            if not self.kernels.wgmma:
                raise ValueError("HGemm.wgmma: warpgroup MMA needs an sm_90 GPU (H100 / H200)")
            kernel = self.kernels.kernel(
                HGEMM_WG_SOURCE, "hgemm_wg", t.defines(), smem=t.smem_bytes, sm90a=True
            )
        else:
            t = self.tuning
            kernel = self.kernels.kernel(HGEMM_SOURCE, "hgemm", t.defines(), smem=t.smem_bytes)
        grid = -(-m // t.bm) * -(-n // t.bn)
        self.kernels.launch(
            kernel, grid, t.threads, x16.data_ptr(), w16.data_ptr(), out.data_ptr(),
            np.int32(m), np.int32(n), np.int32(k), np.int64(out.stride(0)), shmem=t.smem_bytes,
        )  # fmt: skip
        return out

    def matmul_gate_mix(
        self, x16: torch.Tensor, w16: torch.Tensor, xn: torch.Tensor, mixed: torch.Tensor,
        mixed16: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """A prompt mix's up GEMM and gated mean in one kernel (hgemm_wg_gate_mix, sm_90):
        x16 [M, k] the silu'd low-rank rows, w16 [4 d, k] up's rows interleaved by stream (row
        4 c + s: stream s's row c), xn [M, 4, d] fp32 -> mixed [M, d] fp32 (and its f16 copy
        in ``mixed16``): hc_gate_mix's bits on ``matmul``'s products."""
        m, k = x16.shape
        d = xn.shape[2]
        check_vec4("x16", x16, self.device, torch.float16)
        check_vec4("w16", w16, self.device, torch.float16)
        for name, f32 in (("xn", xn), ("mixed", mixed)):
            check_vec4(name, f32, self.device, torch.float32)
        if not (self.wgmma and self.kernels.wgmma):
            raise ValueError("HGemm.matmul_gate_mix: on hgemm_wgmma.cu only (sm_90, wgmma on)")
        ok = w16.shape == (4 * d, k) and tuple(xn.shape) == (m, 4, d) and k % 8 == 0
        ok = ok and tuple(mixed.shape) == (m, d)  # (check_vec4: both contiguous)
        if not ok or (mixed16 is not None and mixed16.shape != mixed.shape):
            raise ValueError(
                f"hgemm gate mix: x16 {list(x16.shape)}, w16 {list(w16.shape)}, xn "
                f"{list(xn.shape)}, mixed {list(mixed.shape)}: expected [M, k], [4 d, k], "
                "[M, 4, d], [M, d] contiguous"
            )
        if m == 0:
            return
        t = self.wgmma_tiles(4 * d)
        kernel = self.kernels.kernel(
            HGEMM_WG_SOURCE, "hgemm_wg_gate_mix", t.defines(), smem=t.smem_bytes, sm90a=True
        )
        self.kernels.launch(
            kernel, -(-m // t.bm) * -(-4 * d // t.bn), t.threads, x16.data_ptr(),
            w16.data_ptr(), xn.data_ptr(), mixed.data_ptr(),
            0 if mixed16 is None else mixed16.data_ptr(), np.int32(m), np.int32(4 * d),
            np.int32(k), np.int32(d), shmem=t.smem_bytes,
        )  # fmt: skip
