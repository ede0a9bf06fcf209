"""Tile shapes of the warpgroup-MMA kernels (wgmma, sm_90a only: ``Kernels.wgmma``):
kernels/hgemm_wgmma.cu (``HGemm.wgmma``: long prompts' GEMM on W decoded once) and
kernels/qgemm_wgmma.cu (``QGemm.wgmma``: the GEMMs that decode GGUF blocks per CTA, dense and
grouped MoE). Both take k in steps of 64 (one 128-byte swizzled row of f16, kernels/wgmma.cuh)
and give each warpgroup 64 rows of the tile. Results never depend on the tile shape (each
output is one ascending chain of k16 products); only speed does."""

from __future__ import annotations

from dataclasses import dataclass

from mgserve.cuda.checks import tuning_ints

HGEMM_WG_SOURCE = "hgemm_wgmma.cu"
QGEMM_WG_SOURCE = "qgemm_wgmma.cu"
MAX_SMEM = 227 * 1024  # dynamic shared memory a CTA may opt into on sm_90
# The formats QGemm takes to qgemm_wgmma.cu: those whose kernels fit the default tile's register
# cap (two CTAs an SM) without spilling under NVRTC 13.0. The others (Q4_0, Q5_K, IQ4_XS, the
# IQ and low-bit K types: 12-64 bytes of spilled row pointers each) keep qgemm.cu until their
# wgmma kernels are timed; both give the same bits, so the choice never changes a result.
# (Tilings of three buffers spill more: QWgmmaTuning's docstring.)
WGMMA_FORMATS = frozenset({"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16", "BF16", "F32"})


@dataclass(frozen=True)
class WgmmaTuning:
    """Compile-time tile shape of kernels/hgemm_wgmma.cu (its HW_* -D macros); a ring of ``stages``
    buffers."""

    bm: int = 128  # output rows per CTA: 64 per warpgroup
    bn: int = 256  # output columns per CTA (one wgmma's N)
    stages: int = 4  # shared buffers in the cp.async ring
    group_m: int = 8  # tile rows per group of the CTA order (L2 reuse)

    def __post_init__(self) -> None:
        if self.bm not in (64, 128) or self.bn not in (128, 256) or self.group_m < 1:
            raise ValueError(
                f"WgmmaTuning: bm {self.bm} (64 or 128), bn {self.bn} (128 or 256), group_m "
                f"{self.group_m} (>= 1)"
            )
        if not 3 <= self.stages <= 8 or self.smem_bytes > MAX_SMEM:
            raise ValueError(
                f"WgmmaTuning: {self.stages} stages ({self.smem_bytes} bytes of shared memory; "
                "3..8 stages within 227 KB)"
            )

    @property
    def threads(self) -> int:
        return 2 * self.bm  # a warpgroup (128 threads) per 64 rows

    @property
    def smem_bytes(self) -> int:
        """The ring of ``stages`` (bm + bn) x 64 f16 tiles, and 1024 bytes to align it."""
        return self.stages * (self.bm + self.bn) * 128 + 1024

    @classmethod
    def parse(cls, text: str) -> WgmmaTuning:
        """ "BM,BN,STAGES[,GROUP_M]" as a bench flag."""
        return cls(*tuning_ints(text, "wgmma", "BM,BN,STAGES[,GROUP_M]"))

    def defines(self) -> tuple[tuple[str, str], ...]:
        return (
            ("HW_BM", str(self.bm)),
            ("HW_BN", str(self.bn)),
            ("HW_STAGES", str(self.stages)),
            ("HW_GROUP_M", str(self.group_m)),
        )


QW_BMS = (64, 128, 192, 256)  # qgemm_wgmma.cu's tile rows: 1 to 4 warpgroups
ROW_FORMATS = frozenset({"Q4_K", "Q5_0", "Q8_0"})  # qgemm_rows.cuh's readers (QWgmmaTuning.rows)
# readers written and host-tested (test_qgemm_rows_host.py), not yet run on a GPU: not used
# unless added to ROW_FORMATS (test_qgemm_wgmma.py's GPU test of them does so)
ROW_FORMATS_UNTRIED = frozenset({"Q6_K", "Q5_K", "Q5_1"})
# formats whose qgemm_wgmma.cu kernels are written (with a row reader), not yet run on a GPU:
# qgemm.cu's take them until added to WGMMA_FORMATS (test_untried_row_readers does so)
WGMMA_FORMATS_UNTRIED = frozenset({"Q5_K", "Q5_1"})  # (a Q5_K file's fallback below 256)


@dataclass(frozen=True)
class QWgmmaTuning:
    """Compile-time tile shape of kernels/qgemm_wgmma.cu (its QW_* -D macros, QG_TYPE per
    format); two shared buffers (the W tile of the next step is decoded into the other), or three
    (X copied and W fetched two steps ahead: neither load waited for in the step that issues
    it; the raw W registers then live across the barrier: at 128 x 128 on two CTAs an SM F32
    spills 16-32 bytes and, with the runs' reader, Q4_K 4-8 in the MoE kernels; at 64 x 256
    most formats spill).
    ``decode`` 1 forms W's values from GGUF blocks by shifts and masks as before 2026-12-07
    (gguf_split.cuh's SPLIT_DECODE, kept to time against), 2 by byte permutes. ``rows``: the W
    tiles of ROW_FORMATS read by half row-steps (kernels/qgemm_rows.cuh: a thread's 32 values
    of a step from few wide loads, the scales once for them; Q4_K's runs' reader makes 20 loads
    and four scale / min pairs for them, and the decode was most of the MoE kernels'
    instructions, Nsight 2026-12-07 23:10), where 2 x bn divides by the threads; other formats
    and shapes keep the runs (ROWS 0 in a bench flag: the runs for every format). Every shape,
    decode and reader gives the same bits."""

    bm: int = 128  # output rows per CTA: 64 per warpgroup
    bn: int = 128  # output columns per CTA (one wgmma's N)
    min_ctas: int = 2  # CTAs per SM the registers are capped for (__launch_bounds__)
    stages: int = 2  # shared buffers: 2 or 3
    decode: int = 2  # gguf_split.cuh's SPLIT_DECODE: 2 byte permutes, 1 shifts and masks
    # ROW_FORMATS' W by half row-steps (QW_ROWS), bitwise the runs' reader: a 4096-token
    # qwen4exp chunk +8.3% at depth 0 and +6.1% at 32768, the grouped products of qwen4exp's
    # shapes 0.88-1.11 ms against 0.93-1.26 (H100, paired 3, BENCHMARKS.md 2026-12-07 23:49)
    rows: bool = True

    def __post_init__(self) -> None:
        if (
            self.bm not in QW_BMS
            or self.bn not in (128, 256)
            or self.min_ctas not in (1, 2)
            or self.stages not in (2, 3)
            or self.decode not in (1, 2)
            or not isinstance(self.rows, bool)
        ):
            raise ValueError(
                f"QWgmmaTuning: bm {self.bm} (64, 128, 192 or 256), bn {self.bn} (128 or 256), "
                f"min_ctas {self.min_ctas} (1 or 2), stages {self.stages} (2 or 3), "
                f"decode {self.decode} (1 or 2), rows {self.rows!r} (a bool)"
            )
        cap = min(255, 65536 // (self.threads * self.min_ctas))  # registers a thread may use
        if self.bn // 2 + 40 > cap:  # the accumulators and the tile's addressing
            raise ValueError(
                f"QWgmmaTuning: {self.bn // 2} accumulators a thread do not fit {self.min_ctas} "
                f"CTAs of {self.threads} threads an SM ({cap} registers each)"
            )
        if self.smem_bytes > MAX_SMEM:
            raise ValueError(
                f"QWgmmaTuning: {self.stages} buffers of {self.bm} + {self.bn} rows need "
                f"{self.smem_bytes} bytes of shared memory ({MAX_SMEM} a CTA)"
            )

    @property
    def threads(self) -> int:
        return 2 * self.bm

    @property
    def smem_bytes(self) -> int:
        """``stages`` (bm + bn) x 64 f16 buffers, and 1024 bytes to align them."""
        return self.stages * (self.bm + self.bn) * 128 + 1024

    def reads_rows(self, type_name: str) -> bool:
        """Whether ``type_name``'s W tiles are read by half row-steps: ``rows``, a format with a
        reader, decode 2 (decode 1, shifts and masks, is the runs' reader's alternative) and a
        tile whose half rows the threads share out evenly (qgemm_wgmma.cu's ROWS: 2 bn a
        multiple of 2 bm; not 192 rows)."""
        return (self.rows and self.decode == 2 and type_name in ROW_FORMATS
                and self.bn % self.bm == 0)  # fmt: skip

    def with_rows(self, bm: int) -> QWgmmaTuning:
        """This shape on tiles of ``bm`` rows: its columns where they fit the registers (two CTAs
        an SM if they can), else 128 columns; ValueError naming bm where no kernel has such rows."""
        for bn, min_ctas in ((self.bn, 2), (self.bn, 1), (128, 2)):
            try:
                return QWgmmaTuning(bm, bn, min_ctas, self.stages, self.decode, self.rows)
            except ValueError:
                continue
        return QWgmmaTuning(bm, 128, 1, self.stages, self.decode, self.rows)

    @classmethod
    def parse(cls, text: str) -> QWgmmaTuning:
        """ "BM,BN[,MIN_CTAS[,STAGES[,DECODE[,ROWS]]]]" as a bench flag (ROWS 0 or 1)."""
        v = tuning_ints(text, "qgemm wgmma", "BM,BN[,MIN_CTAS[,STAGES[,DECODE[,ROWS]]]]")
        if len(v) == 6 and v[5] not in (0, 1):
            raise ValueError(f"qgemm wgmma tuning {text!r}: ROWS is 0 or 1")
        ints = dict(zip(("bm", "bn", "min_ctas", "stages", "decode"), v, strict=False))
        return cls(**ints, rows=v[5] == 1 if len(v) == 6 else cls.rows)

    def defines(self, type_name: str) -> tuple[tuple[str, str], ...]:
        return (
            (
                ("QG_TYPE", type_name),
                ("QW_BM", str(self.bm)),
                ("QW_BN", str(self.bn)),
                ("QW_MIN_CTAS", str(self.min_ctas)),
            )
            + ((("QW_STAGES", str(self.stages)),) if self.stages != 2 else ())
            + ((("SPLIT_DECODE", str(self.decode)),) if self.decode != 2 else ())
            + ((("QW_ROWS", "1"),) if self.reads_rows(type_name) else ())
        )
