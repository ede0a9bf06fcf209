"""Every (kernel source, -D defines) the CUDA backend can ask NVRTC for: the compile units that
``mgserve kernels check`` (offline.py) compiles without a GPU.

``Kernels.kernel(source, name, defines)`` compiles one module per (source, defines), holding every
kernel function of the file, so a variant is a source and one define set. The sets come from the
helpers and tables the ops themselves call (``MatvecTuning.defines``, ``q8_defines``,
``QGemmTuning.defines`` of ``DENSE_TUNING`` / ``GROUPED_TUNING``, ``decode_defines``,
``flash_defines``, ``conv_defines``, ``step_defines``, ``prefill_defines``, ``moe_defines``,
``HCTuning.defines``), over the ranges the ops accept: every format of ``weights.FORMATS`` for
the per-format modules (qgemm.cu, hc.cu), every head dim of ``HEAD_DIMS`` and K/V pool kind for
attention, every conv width 1..MAX_CONV_K. tests/cuda/test_kernel_variants.py lists the call
sites of ``Kernels.kernel`` this inventory covers and fails on one it does not know.

Covered: what ``cuda_backend`` (``mgserve serve``) builds, i.e. the default tunings, and
``deltanet.scan_tc``'s one variant (every kernel file is compiled), and gguf_split.cuh's
shifts-and-masks readers in qgemm_wgmma.cu (``--moe-tiles wg:128,128,2,2,1,0``: the code a bench
times against stays compiled), the runs' readers where half row-steps are the default
(``wg:128,128,2,2,2,0``), the clustered HC mix with ``stage_hoist`` off in a Q4_K_M file's
formats (``--toggle hc.stage_hoist``), and the router and the int8 gate/up with fenced tickets
(``--toggle route.tickets.acq_rel``). Not covered: the tunings only
benchmarks choose (``bench matvec --tunings / --q8-rows``, ``bench model --hgemm /
--moe-tiles``, ``MoeCuda(moe_rows=...)``, ``--set deltanet.scan_cols=16``), and DeltaNet decode
head dims other than 64, 128 and 256 (the runtime takes any up to MAX_STEP_HEAD_DIM; the models
served use 128).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from mgserve.cuda.ops.act import ACT_SOURCE
from mgserve.cuda.ops.attention_cuda import ATTN_SOURCE, HEAD_DIMS, decode_defines
from mgserve.cuda.ops.attention_prefill import PREFILL_SOURCE as FLASH_SOURCE
from mgserve.cuda.ops.attention_prefill import flash_defines
from mgserve.cuda.ops.deltanet_cuda import (
    DELTANET_SOURCE,
    MAX_CONV_K,
    MAX_STEP_HEAD_DIM,
    conv_defines,
    step_defines,
)
from mgserve.cuda.ops.deltanet_prefill_cuda import (
    PREFILL_HEAD_DIM,
    SCAN_TC_SOURCE,
    prefill_defines,
    scan_tc_defines,
)
from mgserve.cuda.ops.deltanet_prefill_cuda import PREFILL_SOURCE as CHUNKED_SOURCE
from mgserve.cuda.ops.embed import EMBED_SOURCE
from mgserve.cuda.ops.hc import CLUSTER_TUNING, CLUSTER_XQ_TUNING, HC_SOURCE, HCTuning
from mgserve.cuda.ops.hgemm import HGEMM_SOURCE, NARROW_TUNING, HGemmTuning
from mgserve.cuda.ops.linear_cuda import DEQUANT_SOURCE
from mgserve.cuda.ops.linear_tuning import (
    MATVEC_SOURCE,
    Q8_ROWS,
    Q8_SOURCE,
    Q8_THREADS,
    MatvecTuning,
    q8_defines,
)
from mgserve.cuda.ops.moe_cuda import (
    MOE_Q8_SOURCE,
    MOE_ROWS,
    MOE_SOURCE,
    SHARED_SOURCE,
    moe_defines,
)
from mgserve.cuda.ops.moe_prefill_cuda import MOE_PREFILL_SOURCE
from mgserve.cuda.ops.norm import NORM_SOURCE
from mgserve.cuda.ops.qgemm import DENSE_TUNING, GROUPED_TUNING, QGEMM_SOURCE
from mgserve.cuda.ops.qsa_cuda import SELECT_SOURCE, UTIL_SOURCE
from mgserve.cuda.ops.route import BATCH_DEFINES, LEAN_DEFINES, LEAN_TUNING, ROUTE_SOURCE
from mgserve.cuda.ops.wgmma import (
    HGEMM_WG_SOURCE,
    QGEMM_WG_SOURCE,
    ROW_FORMATS,
    ROW_FORMATS_UNTRIED,
    WGMMA_FORMATS,
    QWgmmaTuning,
    WgmmaTuning,
)
from mgserve.cuda.weights import FORMATS

Defines = tuple[tuple[str, str], ...]
TEST_SOURCES = ("util.cu",)  # loaded by the tests only (spin_ns: tests/cuda/conftest.py)
STEP_HEAD_DIMS = (64, 128, MAX_STEP_HEAD_DIM)  # DeltaNet decode head dims compiled offline


class Variant(NamedTuple):
    source: str  # a .cu file of kernels/
    defines: Defines  # as the op passes them (order kept: it is part of the cubin cache key)
    tag: str  # which request this is, e.g. "Q4_K dense" ("" for a source's only variant)
    sm90a: bool = False  # compiled for sm_90a (wgmma): only when checking sm_90 (offline.check)

    @property
    def label(self) -> str:
        return f"{self.source}[{self.tag}]" if self.tag else self.source


def _qgemm() -> list[Variant]:
    tilings = [("dense", DENSE_TUNING)]
    if GROUPED_TUNING != DENSE_TUNING:  # one module serves both when they agree
        tilings.append(("grouped", GROUPED_TUNING))
    return [
        Variant(QGEMM_SOURCE, t.defines(f), f"{f} {name}") for f in FORMATS for name, t in tilings
    ]


def _attention() -> list[Variant]:
    out = []
    for d in HEAD_DIMS:
        for kq in (False, True):
            for vq in (False, True):
                tag = f"d{d} k{'q8' if kq else 'f16'} v{'q8' if vq else 'f16'}"
                out.append(Variant(ATTN_SOURCE, decode_defines(d, kq, vq), tag))
                out.append(Variant(FLASH_SOURCE, flash_defines(d, kq, vq), tag))
    return out


def _deltanet() -> list[Variant]:
    out = [Variant(DELTANET_SOURCE, (), "gates")]
    out += [
        Variant(DELTANET_SOURCE, conv_defines(k, vec), f"conv k{k}{' vec' if vec else ''}")
        for k in range(1, MAX_CONV_K + 1)
        for vec in (False, True)
    ]
    out += [Variant(DELTANET_SOURCE, step_defines(d), f"step d{d}") for d in STEP_HEAD_DIMS]
    out += [
        Variant(CHUNKED_SOURCE, prefill_defines(PREFILL_HEAD_DIM, k), f"d{PREFILL_HEAD_DIM} k{k}")
        for k in range(1, MAX_CONV_K + 1)
    ]
    out.append(Variant(SCAN_TC_SOURCE, scan_tc_defines(PREFILL_HEAD_DIM), f"d{PREFILL_HEAD_DIM}"))
    return out


ACQ_REL = (("TICKET_ACQREL", "1"),)  # Tickets.acq_rel's define
BATCH10 = replace(LEAN_TUNING, unroll=10).defines()  # route.unroll=10


def variants() -> list[Variant]:
    """Every variant the runtime can request (module docstring), sources in family order."""
    plain = [ACT_SOURCE, EMBED_SOURCE, NORM_SOURCE, ROUTE_SOURCE, UTIL_SOURCE, SELECT_SOURCE]
    plain += [SHARED_SOURCE, MOE_PREFILL_SOURCE, DEQUANT_SOURCE, *TEST_SOURCES]
    out = [
        Variant(MATVEC_SOURCE, MatvecTuning().defines(), ""),
        # the router: route.lean (the default) and off (the matvec's tuning), each with the
        # last-CTA tickets by one acq_rel atomic (route.tickets.acq_rel, the default) and by
        # fences (to time it)
        Variant(ROUTE_SOURCE, LEAN_TUNING.defines() + LEAN_DEFINES + ACQ_REL, "lean acq_rel"),
        Variant(ROUTE_SOURCE, LEAN_TUNING.defines() + LEAN_DEFINES, "router lean"),
        # route.batch with route.unroll 10: a 2560-wide (qwen4exp) router row's loads at once
        Variant(ROUTE_SOURCE, BATCH10 + LEAN_DEFINES + BATCH_DEFINES + ACQ_REL, "lean batch 10"),
        Variant(ROUTE_SOURCE, MatvecTuning().defines() + ACQ_REL, "router acq_rel"),
        Variant(ROUTE_SOURCE, MatvecTuning().defines(), "router"),
        Variant(Q8_SOURCE, q8_defines(Q8_ROWS, Q8_THREADS), ""),
        Variant(MOE_SOURCE, moe_defines(MOE_ROWS), ""),
        Variant(MOE_Q8_SOURCE, moe_defines(MOE_ROWS), ""),
        Variant(MOE_Q8_SOURCE, moe_defines(MOE_ROWS) + ACQ_REL, "acq_rel"),
        Variant(HGEMM_SOURCE, HGemmTuning().defines(), ""),
        Variant(HGEMM_WG_SOURCE, WgmmaTuning().defines(), "sm_90a", sm90a=True),
        Variant(HGEMM_WG_SOURCE, NARROW_TUNING.defines(), "narrow sm_90a", sm90a=True),
    ]
    out += [Variant(s, (), "") for s in plain]
    out += _qgemm()
    out += [
        Variant(QGEMM_WG_SOURCE, QWgmmaTuning().defines(f), f"{f} sm_90a", sm90a=True)
        for f in FORMATS
        if f in WGMMA_FORMATS
    ]
    shifts = QWgmmaTuning(decode=1, rows=False)
    out += [  # gguf_split.cuh's shifts-and-masks readers, kept to time against (bench --moe-tiles)
        Variant(QGEMM_WG_SOURCE, shifts.defines(f), f"{f} decode 1 sm_90a", True)
        for f in ("Q4_K", "Q5_0", "Q6_K", "Q8_0")
    ]
    out += [  # the runs' reader where a half row-step one is the default (--moe-tiles ...,2,2,2,0)
        Variant(QGEMM_WG_SOURCE, QWgmmaTuning(rows=False).defines(f), f"{f} runs sm_90a", True)
        for f in sorted(ROW_FORMATS)
    ]
    out += [  # readers not yet run on a GPU, compiled as they would be (ROW_FORMATS_UNTRIED)
        Variant(
            QGEMM_WG_SOURCE,
            (*QWgmmaTuning().defines(f), ("QW_ROWS", "1")),
            f"{f} rows sm_90a",
            True,
        )
        for f in sorted(ROW_FORMATS_UNTRIED)
    ]
    out += [Variant(HC_SOURCE, HCTuning().defines(f), f) for f in FORMATS]
    out += [Variant(HC_SOURCE, CLUSTER_TUNING.defines(f, True), f"{f} cluster") for f in FORMATS]
    out += [
        Variant(HC_SOURCE, CLUSTER_XQ_TUNING.defines(f, True), f"{f} cluster xq") for f in FORMATS
    ]
    out += [  # HCCuda.stage_hoist off (to time it), the formats of a Q4_K_M file's mixes
        Variant(HC_SOURCE, replace(t, stage_hoist=False).defines(f, True), f"{f} {tag} branched")
        for f in ("Q4_K", "Q5_0", "Q6_K", "Q8_0")
        for t, tag in ((CLUSTER_TUNING, "cluster"), (CLUSTER_XQ_TUNING, "cluster xq"))
    ]
    out += _attention() + _deltanet()
    return out
