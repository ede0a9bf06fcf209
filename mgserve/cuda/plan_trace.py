"""The memory plan's "allocator" item: what the CUDA caching allocator hands out beyond the bytes
a load asks for (issue 12: an 8-layer qwen4exp slice on an H200 loaded 18,724,480 bytes more than
its tensors, every one of them explained here).

``torch.cuda.memory_allocated`` counts blocks, not requests: each request is rounded up to 512
bytes, and a large-pool block (a fresh segment, or one a freed tensor left) is split only when
more than 1 MiB would remain, so a tensor that leaves at most 1 MiB of its block takes the whole
block (plan_alloc.py). Which blocks those are depends on everything the load allocates and frees
in order (quantized blocks uploaded, rows reordered, the token table, temporaries), so the plan
does not guess it: the load runs once on the ``meta`` device (the CUDA path without memory: the
same tensors, the same order) under a dispatch mode that records every storage made and freed;
the per-slot pools, which the settings size, are appended from the plan's own sizes in the
models' order; the whole is replayed through the allocator model. Exact for the whole model on
one GPU; a pipeline stage's is prorated (``allocator_bytes``).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mgserve.config import Settings
from mgserve.core.models.kvcache import kv_storage
from mgserve.cuda.plan_alloc import Block, CachingAllocator
from mgserve.cuda.plan_sizes import Part

if TYPE_CHECKING:
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.plan_sizes import ModelSizes

META = torch.device("meta")
log = logging.getLogger(__name__)
Event = tuple[int, int]  # (key, bytes): an allocation; (key, -1): its release


class LoadTrace(NamedTuple):
    """A load's device storages in program order, the per-slot pools left out: ``load`` while the
    model is made, ``release`` the synthetic models' device pools freed after it
    (``release_pools``)."""

    load: tuple[Event, ...]
    release: tuple[Event, ...]


class DeviceTrace(TorchDispatchMode):
    """Every ``meta`` storage an op makes, and its release, as ``Event``s in program order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.keys: dict[int, int] = {}  # id of a live storage -> its event key
        self.closed = False

    def _freed(self, sid: int) -> None:
        key = self.keys.pop(sid, None)
        if key is not None and not self.closed:
            self.events.append((key, -1))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device == META:
                st = t.untyped_storage()  # one Python object per storage while it lives
                if id(st) not in self.keys and st.nbytes():
                    key = self.keys[id(st)] = len(self.events)
                    self.events.append((key, st.nbytes()))
                    weakref.finalize(st, self._freed, id(st))
        return out


def _pool_storages(pools: Any) -> set[int]:
    ts = [t for kv in (*pools.k.values(), *pools.v.values()) for t in kv]
    for d in (pools.conv, pools.ssm, pools.blocks, pools.pending):
        ts.extend(d.values())
    if pools.ple_conv is not None:
        ts.append(pools.ple_conv)
    return {id(t.untyped_storage()) for t in ts}


def load_trace(g: GGUFFile, part: Part | None = None) -> LoadTrace:
    """The device storages of loading ``g`` (of ``part``'s layers) on the CUDA path."""
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.synth_device import release_pools

    release_pools("meta")  # the trace makes its synthetic pools as the GPU's first load does
    mode = DeviceTrace()
    with mode:
        model = load_device_model(g, torch_backend(), META, 0, 0, part=part)
        pools = {mode.keys[s] for s in _pool_storages(model.pools) if s in mode.keys}
        n = len(mode.events)
        release_pools("meta")
    mode.closed = True
    load = tuple(e for e in mode.events[:n] if e[0] not in pools)
    return LoadTrace(load, tuple(mode.events[n:]))


def pool_requests(sizes: ModelSizes, settings: Settings, part: Part) -> list[int]:
    """Bytes of each per-slot pool tensor ``SlotPools`` allocates, in the models' order (layer
    by layer: DeltaNet conv and state, or K then V as ``kv_storage`` makes them; then each QSA
    layer's block and pending keys; then the PLE conv history)."""
    s, spec, hp, qp = settings, sizes.spec, sizes.hp, sizes.qp
    n, ctx, out = s.parallel + 1, s.ctx_size, []
    for il in range(part.start, part.stop):
        if hp is not None and hp.recurrent[il]:
            out.append(4 * n * max(hp.ssm_conv - 1, 0) * hp.conv_dim)
            out.append(4 * n * hp.ssm_v_heads * hp.ssm_head_dim**2)
            continue
        for t in (s.cache_type_k, s.cache_type_v):
            shape = (n, ctx, spec.n_head_kv, spec.head_dim)
            out.extend(x.nbytes for x in kv_storage(t, shape, META))
    if qp is not None:
        out += [4 * n * b * qp.idx_dim for il in qp.qsa_layers if il in part
                for b in (ctx // qp.ratio, qp.ratio)]  # fmt: skip
        if qp.ple is not None and qp.ple.layer in part:
            out.append(4 * n * qp.ple.history * qp.hc * spec.n_embd)
    return [b for b in out if b]


def allocator_bytes(sizes: ModelSizes, settings: Settings, part: Part) -> int:
    """What ``memory_allocated`` reads after the load beyond what it asked for (module
    docstring); 0 without the file to trace. A pipeline stage's (a part of the layers) is the
    whole model's in proportion to the bytes the stage asks for: an estimate, as the stage
    planner tries many ranges and a trace costs a load on the meta device each."""
    whole = Part.whole(sizes.spec.n_layer)
    try:
        trace = sizes.trace(whole)
    except Exception as e:  # a refinement of 0.2-0.4%: a file it cannot trace still serves
        name = getattr(sizes.source, "path", "the model")
        log.warning("the memory plan leaves out the allocator's rounding: tracing the load of "
                    "%s on the meta device failed (%s: %s)", name, type(e).__name__, e)  # fmt: skip
        return 0
    if trace is None:
        return 0
    pools = tuple(pool_requests(sizes, settings, whole))
    if pools not in sizes.replays:  # once per settings: the stage planner asks for many parts
        sizes.replays[pools] = replay(trace, pools)
    slack, requested = sizes.replays[pools]
    if part == whole:
        return slack
    asked = sizes.weights_of(part) + sum(pool_requests(sizes, settings, part))
    return slack * asked // requested


def replay(trace: LoadTrace, pools: tuple[int, ...]) -> tuple[int, int]:
    """(blocks beyond the requests, requests) after ``trace``'s load with ``pools`` appended."""
    sim, _ = simulate(trace, pools)
    return sim.allocated - sim.requested, sim.requested


def simulate(
    trace: LoadTrace, pools: tuple[int, ...]
) -> tuple[CachingAllocator, dict[int, tuple[Block | None, int]]]:
    """The allocator model after ``trace``'s load with ``pools`` appended, and the live
    allocations by event key: (block, bytes asked)."""
    sim, live = CachingAllocator(), dict[int, tuple[Block | None, int]]()
    made = [(-1 - i, b) for i, b in enumerate(pools)]
    for key, nbytes in (*trace.load, *made, *trace.release):
        if nbytes < 0:
            sim.free(live.pop(key)[0])
        else:
            live[key] = (sim.malloc(nbytes), nbytes)
    return sim, live
