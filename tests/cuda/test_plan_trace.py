"""The memory plan's "allocator" item (mgserve/cuda/plan_trace.py, plan_alloc.py; issue 12): the
caching-allocator model's rules, the meta-device trace of a load against the plan's items and the
pools' order, and the H200 measurement it reproduces."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mgserve.config import Settings
from mgserve.cuda.plan import ModelSizes, Part, plan
from mgserve.cuda.plan_alloc import CachingAllocator
from mgserve.cuda.plan_trace import META, DeviceTrace, pool_requests
from tests.cuda.test_plan import SETTINGS, _file

MIB = 1 << 20


def test_the_allocator_rounds_small_requests_and_hands_out_large_blocks_whole() -> None:
    a = CachingAllocator()
    small = a.malloc(192)  # small pool: 512-byte multiples
    assert a.allocated - a.requested == 512 - 192
    a.free(small)
    state = a.malloc(15 * MIB)  # a 16 MiB segment: 1 MiB left is not split off
    assert (a.allocated, a.requested) == (16 * MIB, 15 * MIB)
    experts = a.malloc(29_491_200)  # a 30 MiB segment, 1.875 MiB left: split
    assert experts is not None and experts.size == 29_491_200
    hc = a.malloc(1_843_200)  # the best fit is that remainder, 122,880 bytes over: whole
    assert hc is not None and hc.size == 30 * MIB - 29_491_200
    assert a.segments == 3  # the small one, 16 MiB, 30 MiB
    a.free(experts)
    a.free(hc)  # merged back into one free 30 MiB block: 28 MiB splits it, 29 MiB would not
    big = a.malloc(28 * MIB)
    assert big is not None and big.size == 28 * MIB and a.segments == 3
    a.free(state)
    a.free(big)
    assert a.allocated == a.requested == 0


@pytest.mark.parametrize("name", ["llama", "qwen3next", "qwen4exp", "qwen4exp-flash-next"])
@pytest.mark.parametrize("kv", [("q8_0", "f16"), ("f32", "q8_0")])
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_the_trace_holds_what_the_plan_counts_and_the_pools_in_order(
    name: str, kv: tuple[str, str], tmp_path: Path
) -> None:
    """A load traced on the meta device keeps exactly the plan's weights; its pools, made in the
    models' order, are ``pool_requests``' list; part by part too (a pipeline's stages)."""
    from mgserve.cuda.backend import load_device_model, torch_backend

    g = _file(name, tmp_path)
    s = dataclasses.replace(SETTINGS, cache_type_k=kv[0], cache_type_v=kv[1])
    sizes = ModelSizes.of(g)
    n_layer = sizes.spec.n_layer
    for part in (Part.whole(n_layer), Part(0, 1, last=False), Part(1, n_layer, first=False)):
        trace = sizes.trace(part)
        assert trace is not None
        live: dict[int, int] = {}
        for key, nbytes in trace.load:
            live.pop(key) if nbytes < 0 else live.__setitem__(key, nbytes)
        items = {i.name: i.nbytes for i in plan(sizes, s, part)}
        weights = sum(items.get(k, 0) for k in ("weights", "output head", "token embedding"))
        assert sum(live.values()) == weights
        whole = part == Part.whole(n_layer)
        mode = DeviceTrace()
        with mode:
            model = load_device_model(
                g, torch_backend(), META, s.parallel, s.ctx_size, *kv, part=None if whole else part
            )
        pools = model.pools
        ts = [t for x in (*pools.k.values(), *pools.v.values()) for t in x]
        ts += [*pools.conv.values(), *pools.ssm.values(), *pools.blocks.values()]
        ts += [*pools.pending.values(), *([pools.ple_conv] if pools.ple_conv is not None else [])]
        mine = {mode.keys[id(t.untyped_storage())] for t in ts if t.nbytes}
        made = [nbytes for key, nbytes in mode.events if key in mine]
        assert made == pool_requests(sizes, s, part)
        assert sum(made) == sum(items.get(k, 0) for k in ("KV cache", "QSA block keys",
                                                           "recurrent state"))  # fmt: skip
        assert items.get("allocator", 0) > 0


def test_the_plan_is_what_the_h200_loaded() -> None:
    """tests/cuda/test_plan.py's GPU case on an H200 (issue 12): memory_allocated grew by
    4,615,964,672 bytes over the load of the 8-layer, 32-expert qwen4exp slice; the tensors asked
    for 18,724,480 fewer, the caching allocator's rounding and whole blocks."""
    from mgserve.cuda.synth_device import SynthFile

    g = SynthFile.from_shape("qwen4exp-flash-next", layers=8, experts=32, ple_rows=1_000_000)
    s = Settings(parallel=4, ctx_size=16384, cache_type_k="q8_0", cache_type_v="q8_0")
    items = {i.name: i.nbytes for i in plan(ModelSizes.of(g), s)}
    assert items["allocator"] == 18_724_480
    device = ("weights", "output head", "token embedding", "KV cache", "QSA block keys")
    assert sum(items[k] for k in (*device, "recurrent state", "allocator")) == 4_615_964_672
    assert not torch.cuda.is_initialized()  # all of it on the CPU


def test_a_load_that_cannot_be_traced_leaves_the_item_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The allocator item refines the plan; a file the meta trace fails on still gets a plan."""
    from mgserve.cuda import plan_trace

    sizes = ModelSizes.of(_file("qwen4exp-flash-next", tmp_path))

    def fail(g: object, part: object = None) -> None:
        raise RuntimeError("no meta kernel for this op")

    monkeypatch.setattr(plan_trace, "load_trace", fail)
    with caplog.at_level("WARNING"):
        items = {i.name for i in plan(sizes, SETTINGS)}
    assert "allocator" not in items and "weights" in items
    assert "no meta kernel for this op" in caplog.text


def test_the_allocator_is_replayed_once_per_pool_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage planner asks for the plan of every range of layers it tries (hundreds): the
    whole model's replay, which the prorated item of each comes from, runs once per settings
    that size the pools, not once per range (a 48-layer model: 0.1 s of planning, not 10 s)."""
    from mgserve.cuda import plan_trace

    sizes = ModelSizes.of(_file("qwen4exp-flash-next", tmp_path))
    made: list[int] = []

    class Counted(CachingAllocator):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(plan_trace, "CachingAllocator", Counted)
    n = sizes.spec.n_layer
    got = [
        {i.name: i.nbytes for i in plan(sizes, SETTINGS, Part(a, b, a == 0, b == n))}
        for a, b in [(0, n), (0, 1), (1, n), (0, 1), (1, n)]
    ]
    assert len(made) == 1 and got[1] == got[3] and got[2] == got[4]
    assert all(g["allocator"] > 0 for g in got)
    plan(sizes, dataclasses.replace(SETTINGS, ctx_size=2 * SETTINGS.ctx_size))
    assert len(made) == 2  # other pools: another replay
