"""``QGemm``: the prompt GEMMs of the linear and MoE families on tensor cores, reading W in its
GGUF blocks (kernels/qgemm.cu: the tiling, the pipeline and why a result is batch-invariant).

- ``matmul``: y [M, n_out] fp32 = x [M, k] @ W^T for any M >= 1 (``LinearCuda.matmul`` uses it
  for prompt chunks of fewer than ``HGemmTuning.min_rows`` tokens);
- ``dequantize``: rows of W as the f16 values ``matmul`` multiplies, bitwise (for ``HGemm``,
  ops/hgemm.py: long prompts decode W once, not once per tile row, with the same results);
- ``gate_up`` / ``down``: the MoE prefill's grouped products over the (token, slot) pairs sorted
  by expert, tiles never mixing experts, sized on the device (no host sync: the grid covers the
  worst case, ``grouped_tiles``, and CTAs past the last tile exit).

x is rounded to f16 once (to nearest even, as the cuBLAS path did) and W's values to f16 as they
are decoded; products accumulate in fp32: relative error ~1e-3 of |x| @ |W|^T at worst, ~1e-5
typically. Every output row depends only on its own row of x (or pair) and on W, bitwise, for
any M and any ``QGemmTuning`` (fixed k order, no split-K, masked edges).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from mgserve.cuda.checks import check_cuda, check_vec4, check_weight, tuning_ints
from mgserve.cuda.launch import MAX_GRID_Y, Kernels
from mgserve.cuda.ops.f16_rows import f16_rows
from mgserve.cuda.ops.grouped_rows import GroupedRows
from mgserve.cuda.ops.linear import check_rows
from mgserve.cuda.ops.wgmma import MAX_SMEM, QGEMM_WG_SOURCE, WGMMA_FORMATS, QWgmmaTuning
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from cuda.core import Kernel

QGEMM_SOURCE = "qgemm.cu"
STATIC_SMEM = 48 * 1024  # the kernels' shared tiles are static: at most 48 KB
DEQUANT_THREADS = 256  # DEQUANT_THREADS in qgemm.cu: one thread per 8-value run


def check_tiles(tuning: object, bm: int, bn: int, bk: int, warps_m: int, warps_n: int) -> None:
    """ValueError (naming ``tuning``'s class) unless the tile shape suits qgemm.cu and hgemm.cu:
    k steps of 16, 32 or 64 (whole k16 products; hgemm.cu's swizzle), 1..16 warps each owning
    whole m16 x n16 tiles, and 16-byte copies of the X and W tiles shared evenly by the threads."""
    name, threads, chunks = type(tuning).__name__, 32 * warps_m * warps_n, bk // 8
    if bk not in (16, 32, 64):
        raise ValueError(f"{name}.bk must be 16, 32 or 64, got {bk}")
    if not 1 <= warps_m * warps_n <= 16 or min(warps_m, warps_n) < 1:
        raise ValueError(f"{name}: {warps_m} x {warps_n} warps (1..16 in all)")
    if bm % (16 * warps_m) or bn % (16 * warps_n):
        raise ValueError(
            f"{name}: bm {bm} / bn {bn} must be multiples of 16 x warps_m ({warps_m}) / "
            f"16 x warps_n ({warps_n})"
        )
    if (bm * chunks) % threads or (bn * chunks) % threads:
        raise ValueError(
            f"{name}: {threads} threads do not divide the {bm * chunks} X and {bn * chunks} W "
            "16-byte pieces of a k step evenly"
        )


@dataclass(frozen=True)
class QGemmTuning:
    """Compile-time tile shape of kernels/qgemm.cu (its QG_* -D macros). Results never depend on
    it (bitwise); only speed does."""

    bm: int = 128  # output rows (tokens or pairs) per CTA
    bn: int = 128  # output columns (W rows) per CTA
    bk: int = 32  # k per pipeline step
    warps_m: int = 2  # warps along M; a warp owns a (bm / warps_m) x (bn / warps_n) tile
    warps_n: int = 4  # warps along N
    min_ctas: int = 2  # CTAs per SM the registers are capped for (__launch_bounds__)

    def __post_init__(self) -> None:
        check_tiles(self, self.bm, self.bn, self.bk, self.warps_m, self.warps_n)
        if self.smem_bytes > STATIC_SMEM:
            raise ValueError(f"QGemmTuning: {self.smem_bytes} bytes of shared memory > 48 KB")
        if not 1 <= self.min_ctas <= 4:
            raise ValueError(f"QGemmTuning.min_ctas must be in 1..4, got {self.min_ctas}")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def smem_bytes(self) -> int:
        """Two f16 buffers of the X and W tiles, rows padded by 8 halves."""
        return 2 * (self.bm + self.bn) * (self.bk + 8) * 2

    @classmethod
    def parse(cls, text: str) -> QGemmTuning:
        """ "BM,BN,BK,WARPS_M,WARPS_N[,MIN_CTAS]" (e.g. "128,128,32,2,4") as a bench flag."""
        return cls(*tuning_ints(text, "qgemm", "BM,BN,BK,WARPS_M,WARPS_N[,MIN_CTAS]"))

    def defines(self, type_name: str) -> tuple[tuple[str, str], ...]:
        return (
            ("QG_TYPE", type_name),
            ("QG_BM", str(self.bm)),
            ("QG_BN", str(self.bn)),
            ("QG_BK", str(self.bk)),
            ("QG_WARPS_M", str(self.warps_m)),
            ("QG_WARPS_N", str(self.warps_n)),
            ("QG_MIN_CTAS", str(self.min_ctas)),
        )


DENSE_TUNING = QGemmTuning()  # QGemm's default tiles: prompt products of the linear family
# The MoE prefill's grouped products (~M * kk / E rows an expert). Their CTAs decode each W tile
# from GGUF blocks, which costs more than its products, so the rows a CTA amortises it over
# decide the speed: bm 128 is 11% faster than 64 on a 4096-token qwen4exp chunk, bm 256 (bk 16)
# 5% slower (BENCHMARKS.md 2026-12-06 08:37, --moe-tiles).
GROUPED_TUNING = QGemmTuning(bm=128)
GROUPED_WGMMA_TUNING = QWgmmaTuning()  # their qgemm_wgmma.cu twins' (bench --moe-tiles wg:...)


class QGemm:
    """The qgemm.cu launches (see the module docstring), or with ``wgmma`` (the default on
    sm_90) their qgemm_wgmma.cu twins. ``tuning`` / ``wgmma_tuning``: the dense GEMM's tiles;
    ``grouped`` / ``grouped_wgmma``: the MoE kernels' (~M * kk / E rows per expert; bench model
    --moe-tiles compares others, ``wg:...`` the wgmma ones)."""

    def __init__(
        self,
        kernels: Kernels,
        tuning: QGemmTuning | None = None,
        grouped: QGemmTuning | None = None,
        wgmma: bool | None = None,
    ) -> None:
        self.kernels = kernels
        self.device = kernels.device
        self.tuning = tuning or DENSE_TUNING
        self.grouped = grouped or GROUPED_TUNING
        self.wgmma_tuning = QWgmmaTuning()
        self.grouped_wgmma = GROUPED_WGMMA_TUNING  # the wgmma twins' MoE tiles
        # qgemm_wgmma.cu's kernels where the GPU has warpgroup MMA (Kernels.wgmma: sm_90): the
        # same bits (tests/cuda/test_qgemm_wgmma.py); on the H100 a 4096-token prompt 6.5%
        # faster, the grouped MoE products 13% (BENCHMARKS.md, 2026-12-06 17:10)
        self.wgmma = kernels.wgmma if wgmma is None else wgmma
        # shared memory a wgmma CTA holds beyond its tiles (bytes, 0: none): from ~50 KB the MoE
        # tiles' 2 CTAs an SM become 1, leaving half the registers and ~110 KB to decode blocks
        # beside a prefill lane (gpu_stages s43: --set linear.qgemm.room=51200; not measured)
        self.room = 0

    def _kernel(self, tuning: QGemmTuning, name: str, type_name: str) -> Kernel:
        return self.kernels.kernel(QGEMM_SOURCE, name, tuning.defines(type_name))

    def on_wgmma(self, type_name: str) -> bool:
        """Whether ``type_name``'s products run on qgemm_wgmma.cu (``WGMMA_FORMATS``)."""
        return self.wgmma and type_name in WGMMA_FORMATS

    def grouped_bm(self, *type_names: str) -> int:
        """Rows of a grouped MoE tile (``GroupedRows``' bm) for a layer whose gate/up and down
        are in ``type_names``: the wgmma tiles' where every format takes those kernels, else
        qgemm.cu's (the wgmma kernels then run on tiles of that many rows)."""
        if all(self.on_wgmma(t) for t in type_names):
            return self.grouped_wgmma.bm
        return self.grouped.bm

    def _launch(self, tuning: QGemmTuning, name: str, type_name: str, grid_x: int,
                grid_y: int | None, m: int, *args: object, label: str = "qgemm",
                wg: QWgmmaTuning | None = None) -> None:  # fmt: skip
        """``name`` (qgemm.cu's, or its qgemm_wgmma.cu twin, on ``wg`` or the dense tiles) for
        ``type_name`` on a grid of ``grid_x`` column tiles of the kernel's bn (rows of W) by
        ``grid_y`` row tiles (None: ceil(m / bm)); ``args``: the kernel's; ``label`` names the
        weight in errors."""
        if self.on_wgmma(type_name):
            t = wg or self.wgmma_tuning
            if not self.kernels.wgmma:
                raise ValueError("QGemm.wgmma: warpgroup MMA needs an sm_90 GPU (H100 / H200)")
            smem = t.smem_bytes + self.room
            if type(self.room) is not int or not 0 <= self.room <= MAX_SMEM - t.smem_bytes:
                raise ValueError(f"qgemm.room {self.room!r}: 0..{MAX_SMEM - t.smem_bytes} bytes")
            kernel = self.kernels.kernel(
                QGEMM_WG_SOURCE, name + "_wg", t.defines(type_name), smem=smem, sm90a=True
            )
            bm, bn, threads = t.bm, t.bn, t.threads
        else:
            kernel = self._kernel(tuning, name, type_name)
            bm, bn, threads, smem = tuning.bm, tuning.bn, tuning.threads, 0
        y = -(-m // bm) if grid_y is None else grid_y
        if y > MAX_GRID_Y:
            raise ValueError(f"{label}: {m} rows exceed the grid ({MAX_GRID_Y} x {bm})")
        self.kernels.launch(kernel, (-(-grid_x // bn), y), threads, *args, shmem=smem)

    def matmul(
        self, x: torch.Tensor, w: QuantWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, k] fp32 (or f16) -> fp32 [M, w.rows] = f16(x) @ W^T, on the current stream."""
        check_weight(w, self.device)
        if x.dim() != 2 or x.shape[1] != w.k or x.device != self.device:
            raise ValueError(f"{w.name}: x is {list(x.shape)} on {x.device}, expected [M, {w.k}]")
        if x.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"{w.name}: x must be float32 or float16, got {x.dtype}")
        m, k = x.shape
        x16 = f16_rows(x)  # [M, k]
        if out is None:
            out = torch.empty(m, w.rows, dtype=torch.float32, device=self.device)  # [M, rows]
        check_cuda("out", out, self.device, torch.float32)
        if tuple(out.shape) != (m, w.rows):
            raise ValueError(f"{w.name}: out has shape {list(out.shape)}, expected [{m}, {w.rows}]")
        if m == 0 or w.rows == 0:
            return out
        self._launch(
            self.tuning, "qgemm", w.type_name, w.rows, None, m,
            w.data.data_ptr(), x16.data_ptr(), out.data_ptr(),
            np.int32(m), np.int32(w.rows), np.int32(k), label=w.name,
        )  # fmt: skip
        return out

    def dequantize(self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor) -> None:
        """Rows [row0, row0 + n_rows) of W into ``out`` [n_rows, k] f16 (contiguous, 16-byte
        aligned), bitwise the values ``matmul``'s kernel multiplies (qgemm.cu's qgemm_dequant),
        on the current stream: ``HGemm.matmul`` of them equals ``matmul``."""
        check_weight(w, self.device)
        check_rows(w, row0, n_rows, out)
        check_vec4("out", out, self.device, torch.float16)
        if n_rows == 0:
            return
        runs = n_rows * (w.k // 8)
        self.kernels.launch(
            self._kernel(self.tuning, "qgemm_dequant", w.type_name),
            -(-runs // DEQUANT_THREADS), DEQUANT_THREADS,
            w.data.data_ptr(), out.data_ptr(), np.int64(row0), np.int32(n_rows), np.int32(w.k),
        )  # fmt: skip

    def gate_up(
        self,
        gate: QuantWeight,
        up_ptr: int,
        expert_rows: int,
        x16: torch.Tensor,
        row_token: torch.Tensor,
        rows: GroupedRows,
        h: torch.Tensor,
    ) -> None:
        """h [P, ff] f16 = silu(gate_e x16[row_token]) * (up_e x16[row_token]) for the pairs of
        each expert e. ``gate``: the gate (or fused gate_up) tensor; ``up_ptr``: expert 0's up
        row 0; ``expert_rows``: rows per expert of that storage (ff, or 2 ff fused)."""
        p, ff = h.shape
        if p == 0:
            return
        wg = self._grouped_tiles(rows, gate.type_name)
        self._launch(
            self.grouped, "qgemm_gate_up", gate.type_name, 2 * ff, rows.grid_y, p,
            gate.data.data_ptr(), up_ptr, np.int64(expert_rows), x16.data_ptr(),
            row_token.data_ptr(), rows.row_start.data_ptr(), rows.tile_start.data_ptr(),
            h.data_ptr(), np.int32(ff), np.int32(gate.k), np.int32(rows.n_expert), wg=wg,
        )  # fmt: skip

    def down(self, down: QuantWeight, h: torch.Tensor, rows: GroupedRows, y: torch.Tensor) -> None:
        """y [P, d] fp32 = down_e h (h [P, ff] f16) for the pairs of each expert e."""
        p, d = y.shape
        if p == 0:
            return
        wg = self._grouped_tiles(rows, down.type_name)
        self._launch(
            self.grouped, "qgemm_down", down.type_name, d, rows.grid_y, p,
            down.data.data_ptr(), np.int64(d), h.data_ptr(), rows.row_start.data_ptr(),
            rows.tile_start.data_ptr(), y.data_ptr(), np.int32(d), np.int32(down.k),
            np.int32(rows.n_expert), wg=wg,
        )  # fmt: skip

    def _grouped_tiles(self, rows: GroupedRows, type_name: str) -> QWgmmaTuning | None:
        """The wgmma tiles for ``rows`` (``grouped_wgmma``, or its shape on tiles of rows.bm
        rows) if ``type_name`` takes those kernels; qgemm.cu's take only ``grouped.bm`` rows."""
        t = self.grouped_wgmma
        if self.on_wgmma(type_name):
            return t if rows.bm == t.bm else t.with_rows(rows.bm)
        if rows.bm != self.grouped.bm:
            raise ValueError(
                f"grouped GEMM: tiles of {rows.bm} rows for {type_name} kernels of "
                f"{self.grouped.bm} (make GroupedRows with QGemm.grouped_bm of the layer's formats)"
            )
        return None
