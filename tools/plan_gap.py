"""Issue 12: what the CUDA load of a model allocates beyond its tensors, computed on the CPU.

The load is traced on the meta device and replayed through the caching-allocator model
(mgserve/cuda/plan_trace.py, plan_alloc.py), the per-slot pools of the GPU test's settings
appended; this prints what ``memory_allocated`` would read after the load and ``release_pools()``
against the plan's items without the "allocator" one, split by cause (small-pool rounding to 512
bytes; large-pool blocks handed out whole, listed).

Usage: ``PYTHONPATH=. python3 tools/plan_gap.py [shape [layers experts]]`` (default: the GPU
test's slice, qwen4exp-flash-next with 8 layers and 32 experts; H200 measured 4,615,964,672).
"""

from __future__ import annotations

import sys
from collections import Counter

from mgserve.config import Settings
from mgserve.cuda.plan import ModelSizes, Part, plan
from mgserve.cuda.plan_alloc import SMALL_SIZE, round_size
from mgserve.cuda.plan_trace import pool_requests, simulate
from mgserve.cuda.synth_device import SynthFile


def main(argv: list[str]) -> None:
    shape = argv[0] if argv else "qwen4exp-flash-next"
    layers, experts = (int(argv[1]), int(argv[2])) if len(argv) > 2 else (8, 32)
    g = SynthFile.from_shape(shape, layers=layers, experts=experts, ple_rows=1_000_000)
    s = Settings(parallel=4, ctx_size=16384, cache_type_k="q8_0", cache_type_v="q8_0")
    sizes = ModelSizes.of(g)
    items = {i.name: i.nbytes for i in plan(sizes, s)}
    fixed = ("weights", "output head", "token embedding", "KV cache", "QSA block keys")
    want = sum(items.get(k, 0) for k in (*fixed, "recurrent state"))
    part = Part.whole(sizes.spec.n_layer)
    trace = sizes.trace(part)
    assert trace is not None
    sim, live = simulate(trace, tuple(pool_requests(sizes, s, part)))
    print(f"{g.path}: {len(trace.load)} load events, {len(live)} live tensors after the load")
    print(f"planned without the allocator item  {want:>15,}")
    print(f"requested by the live tensors       {sim.requested:>15,}")
    print(f"memory_allocated (model)            {sim.allocated:>15,}  (+{sim.allocated - want:,})")
    small = sum(round_size(n) - n for _, n in live.values() if round_size(n) <= SMALL_SIZE)
    print(f"  small pool, rounded to 512 B      {small:>15,}")
    print(f"  large pool, blocks handed whole   {sim.allocated - sim.requested - small:>15,}")
    whole: Counter[tuple[int, int]] = Counter()
    for b, n in live.values():
        if b is not None and not b.small and b.size != round_size(n):
            whole[(n, b.size)] += 1
    for (n, size), k in sorted(whole.items()):
        print(f"    {k:3d} x {n:>13,} asked, block {size:>13,} (+{size - n:,})")
    print(f"plan's allocator item               {items.get('allocator', 0):>15,}")


if __name__ == "__main__":
    main(sys.argv[1:])
