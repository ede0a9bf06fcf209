"""The command line of ``mgserve bench model`` and the parsing of its workload lists."""

from __future__ import annotations

import argparse

from mgserve.core.synth.mixes import DEFAULT_MIX, MIXES

DEFAULT_DEPTHS = "0,32768,131072,250000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prefill", default="4096@0,4096@32768", help="P@D prefill workloads")
    parser.add_argument(
        "--prefill-repeat", type=int, default=1, help="time each P@D prefill N times: the median"
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        help="time variants side by side: two or more --virtual-stages (every runner kept) or "
        "a --toggle on and off; each --prefill, --decode and --multi-decode workload in N rounds, "
        "once per variant in each round; rows give each variant's median and its ratio to the "
        "first in the same round",
    )
    parser.add_argument(
        "--toggle",
        default="",
        help="with --paired: an op family's boolean switch (qsa.prefill_kernels, "
        "deltanet.prefill_kernels, attention.flash_prefill, ...; several together: a+b) timed "
        "on and off in rounds, or "
        "an int or float setting at each of its values (qsa.score_group=64/256), then "
        "put back (ubatch=2048/4096/8192: the prompt chunk's tokens); decode workloads need "
        "--no-graphs (a graph keeps the setting it was captured "
        "under) except for branch.decode, moe.shared_parts and hc.cluster (graphs are captured "
        "per their setting: cuda/graphs.py); gc.freeze: the heap frozen out of the garbage "
        "collector's sight, as the server has it, or not",
    )
    parser.add_argument("--long-prefill", type=int, default=0, help="one prompt of N tokens")
    parser.add_argument("--multi-prefill", default="", help="S@N: S sessions of N-token prompts")
    parser.add_argument(
        "--sampled-prefill",
        default="",
        help="S@N: S sessions of N-token prompts, estimated from one ubatch step per session at "
        "5 depths spread over the prompt (synthetic state below each); for prompts too long to run",
    )
    parser.add_argument("--decode", default=DEFAULT_DEPTHS, help="1-session decode depths")
    parser.add_argument("--multi-decode", default="5@32768,5@131072", help="B@D decode workloads")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--fill", choices=("synthetic", "prefill"), default="synthetic")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="per-kernel breakdowns: one eager decode step's and a prompt chunk's kernels, and "
        "what each operation adds to served decode steps (CUDA graphs, overlaps counted once)",
    )
    parser.add_argument(
        "--gaps",
        action="store_true",
        help="where the GPU waits for the host in one prompt chunk and one eager decode step: "
        "its idle gaps summed by what launched the work after each (--gaps-by)",
    )
    parser.add_argument(
        "--gaps-by",
        choices=("family", "frame"),
        default="family",
        help="--gaps: by op family method (record_function ranges, close to the host's real "
        "speed) or by Python frame (profiled with Python stacks, which slow the host)",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="the host's time per served decode step by Python function (cProfile over 64 steps "
        "of one session at the deepest --decode depth)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the rows as JSON (what `mgserve bench plot` draws)",
    )


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """What ``ModelBench`` loads and how: the model, its pools and the backend's modes (shared
    with ``mgserve bench invariance`` and ``structured``); ``required``: --model or --shape."""
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--model", help="a GGUF file")
    src.add_argument("--shape", help="a synthetic model of this shape (see mgserve synth)")
    parser.add_argument("--layers", type=int, default=None, help="synthetic: layers")
    parser.add_argument("--experts", type=int, default=None, help="synthetic: routed experts")
    parser.add_argument("--ple-rows", type=int, default=None, help="synthetic: PLE table rows")
    parser.add_argument(
        "--mix", default=DEFAULT_MIX, choices=sorted(MIXES), help="synthetic: quant type mix"
    )
    parser.add_argument("--ctx", type=int, default=262144, help="context per slot")
    parser.add_argument("--slots", type=int, default=5, help="slots (sessions) in the pools")
    parser.add_argument("--cache-type", default="q8_0", help="K and V cache type")
    parser.add_argument("--ubatch", type=int, default=4096, help="prompt tokens per step")
    parser.add_argument("--int8", action="store_true", help="int8-activation matvecs")
    parser.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    parser.add_argument(
        "--virtual-stages",
        default="1",
        help="run the model as N layer-pipeline stages on the one GPU (pipeline/staged.py), "
        "NxM with decode in M micro-batches; a list (1,3,6x3) runs every workload for each in "
        "turn on the one loaded model: the pipeline machinery's overhead against N = 1",
    )
    parser.add_argument(
        "--link-gbps",
        default="",
        help="virtual stages: the links' rates in GB/s, one for all or one per link "
        "(3.15,2.12,1.07,1.07,1.6: the seed's PCIe 3.0 hops through host memory), each "
        "hand-off slowed to its bytes at that rate",
    )
    parser.add_argument(
        "--pow2-buckets",
        action="store_true",
        help="decode graphs for 1, 2, 4, 8, 16 sessions only, padding the rest (compare)",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch each kernel after the previous one ends (no programmatic dependent launch)",
    )
    parser.add_argument(
        "--cublas-prefill",
        action="store_true",
        help="prompt GEMMs on dequantized f16 weights and cuBLAS instead of qgemm.cu (compare)",
    )
    parser.add_argument(
        "--hgemm",
        default=None,
        metavar="TUNING",
        help="long prompts' f16 GEMM (hgemm.cu): BM,BN,BK,STAGES,WARPS_M,WARPS_N[,MIN_CTAS"
        "[,GROUP_M[,MIN_ROWS]]] (MIN_ROWS: prompt rows from which it replaces qgemm.cu); "
        "hgemm.cu's own mma.sync kernel, so its wgmma twin (sm_90) is off for the run",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FAMILY.ATTR=VALUE",
        help="an op family's setting for the whole run (e.g. deltanet.prefill_piece=1024), of the "
        "attribute's own type (int, float or bool); repeatable",
    )
    parser.add_argument(
        "--moe-tiles",
        default="",
        metavar="TUNING[/TUNING...]",
        help="the MoE prompt kernels' tiles (qgemm.cu, grouped): BM,BN,BK,WARPS_M,WARPS_N"
        "[,MIN_CTAS]; with --paired, two or more separated by / are timed side by side. These "
        "are qgemm.cu's mma.sync kernels: their wgmma twins (sm_90) are off for the run, for "
        "short dense prompts too. wg:BM,BN[,MIN_CTAS[,STAGES]] tiles the wgmma twins "
        "instead (qgemm_wgmma.cu; BM 64 / 128 / 192 / 256; STAGES 2 or 3 shared buffers)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the torch backend on the CPU (small models: tests of the bench itself)",
    )


def pairs(text: str) -> list[tuple[int, int]]:
    """``"A@B,C@D"`` -> [(A, B), (C, D)]; a missing ``@B`` reads as 0."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("@")
        out.append((int(a), int(b or 0)))
    return out


def depths(text: str) -> list[int]:
    """``"0,32768"`` -> [0, 32768]."""
    return [int(d) for d in text.split(",") if d.strip()]
