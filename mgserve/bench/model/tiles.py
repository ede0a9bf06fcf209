"""``bench model --moe-tiles``: the MoE prompt kernels' tilings a run sets or compares
(``--paired``), qgemm.cu's mma.sync ones or, written ``wg:...``, their qgemm_wgmma.cu twins'."""

from __future__ import annotations

from typing import Any


def moe_tilings(text: str) -> list[Any]:
    """``--moe-tiles A/B/...``: qgemm.cu's grouped tilings (QGemmTuning, BM,BN,BK,WARPS_M,
    WARPS_N[,MIN_CTAS]) or, each written ``wg:BM,BN[,MIN_CTAS[,STAGES[,DECODE[,ROWS]]]]``,
    their wgmma twins' (QWgmmaTuning); one kind in a run (qgemm.cu's turn the twins off)."""
    from mgserve.cuda.ops.qgemm import QGemmTuning
    from mgserve.cuda.ops.wgmma import QWgmmaTuning

    parts = [t.strip() for t in text.split("/") if t.strip()]
    wg = [t.startswith("wg:") for t in parts]  # wgmma tiles
    if any(wg) and not all(wg):
        raise ValueError(f"--moe-tiles {text!r}: all tilings wg:... (wgmma) or none")
    if any(wg):
        return [QWgmmaTuning.parse(t[3:]) for t in parts]
    return [QGemmTuning.parse(t) for t in parts]


def is_wgmma(t: Any) -> bool:
    """Whether tiling ``t`` (``moe_tilings``) tiles the wgmma twins (QWgmmaTuning)."""
    from mgserve.cuda.ops.wgmma import QWgmmaTuning

    return isinstance(t, QWgmmaTuning)


def tiling_label(t: Any) -> str:
    if is_wgmma(t):
        tail = [t.stages, t.decode, int(t.rows)]
        while tail and tail[-1] == (2, 2, 1)[len(tail) - 1]:  # the defaults left off the end
            tail.pop()
        return "wg:" + ",".join(str(v) for v in [t.bm, t.bn, t.min_ctas, *tail])
    return f"{t.bm},{t.bn},{t.bk},{t.warps_m},{t.warps_n},{t.min_ctas}"


def set_moe_tiles(qgemm: Any, t: Any) -> None:
    """The MoE prompt kernels' tiles of ``qgemm`` (QGemm): ``grouped_wgmma`` for a
    QWgmmaTuning, else ``grouped``."""
    setattr(qgemm, "grouped_wgmma" if is_wgmma(t) else "grouped", t)
