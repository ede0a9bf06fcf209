"""Whole-model prefill and decode throughput on the device backend (the issue-4 table).

The model is a GGUF file (``--model``, any tool's layout) or a synthetic model of a named shape
made directly in GPU memory (``--shape``; random valid blocks, no file; ``--mix`` picks its quant
types, by default llama-quantize Q4_K_M's). Every workload goes through the ``DeviceRunner``
exactly as serving does (scheduler-shaped batches, graphs, device sampling, one event per step):

- prefill: a prompt of P tokens in chunks of ``--ubatch``, at depth D (the session first holds D
  tokens); tokens/s over the timed prompt;
- decode: B sessions at depth D, ``--decode-steps`` timed steps after warm-up; aggregate tokens/s.

Depth is reached either by really prefilling (``--fill prefill``) or by writing random state into
the pools (``--fill synthetic``: random q8_0/f16 K/V, block keys and recurrent states for positions
< D), which costs seconds instead of minutes; attention's cost depends on the depth, not on the
values. ``--profile`` adds per-kernel breakdowns of one eager decode step and one prefill ubatch
(torch.profiler, with wall time and launch counts) and the achieved bandwidth against the card's
copy rate.

    args.py       the command line and its workload lists (``P@D``, ``B@D``, depths)
    harness.py    ModelBench: the loaded model and its runner, scheduler-shaped steps, depth fill
    workloads.py  the timed workloads: prefill, interleaved and sampled prefill, decode
    profile.py    weight bytes read per decode token; kernel times of a step
    host.py       ``--host-profile``: the host's share of a served decode step by function
    tiles.py      ``--moe-tiles``: the MoE prompt kernels' tilings
    report.py     ``run``: the table, printed row by row as it is measured, and ``--record``
"""

from __future__ import annotations

from mgserve.bench.model.args import add_arguments
from mgserve.bench.model.report import run

__all__ = ["add_arguments", "run"]
