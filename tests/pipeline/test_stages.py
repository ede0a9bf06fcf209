"""The stage plan (mgserve/pipeline/stages.py) on the tiny models and the full-width synthetic
shapes: contiguous ranges covering every layer, each stage's memory plan within its GPU and
summing to the one-GPU plan, the ends where they belong, the balanced split against brute force,
--tensor-split honoured, measured times moving layers, and refusals that name the GPU."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest

from mgserve.config import Settings
from mgserve.cuda.plan import ModelSizes, Part, device_total, plan
from mgserve.pipeline.costs import ModelCosts
from mgserve.pipeline.stages import (
    Balance,
    StagePlan,
    StagePlanError,
    best_split,
    fitted_plan,
    split_shares,
    stage_plan,
)
from tests.cuda.test_plan import SYNTH, _file

GIB = 1 << 30
S = Settings(parallel=2, ctx_size=512, cache_type_k="q8_0", cache_type_v="f16", batch_size=64)
# the seed's machine's sessions, in llama.cpp's 512-token prompt chunks
SEED = Settings(
    parallel=5, ctx_size=262144, cache_type_k="q8_0", cache_type_v="q8_0", batch_size=512
)


@pytest.fixture(scope="module")
def flash() -> ModelCosts:
    """The full-width qwen4exp shape (48 layers, 512 experts, the seed's quant mix)."""
    from mgserve.cuda.synth_device import SynthFile

    g = SynthFile.from_shape("qwen4exp-flash-next", mix="ud-q4_k_xl")
    return ModelCosts.of(g, "q8_0", "q8_0")


def _free(n: int, nbytes: int) -> list[tuple[int, str]]:
    return [(nbytes, "test")] * n


def _check(p: StagePlan, sizes: ModelSizes, s: Settings) -> None:
    """Contiguous, covering, within memory, and the stages' items summing to the whole plan."""
    n = sizes.spec.n_layer
    assert p.ranges[0][0] == 0 and p.ranges[-1][1] == n
    assert all(a < b for a, b in p.ranges)
    assert all(x[1] == y[0] for x, y in itertools.pairwise(p.ranges))
    for st in p.stages:
        assert st.total <= st.free
        assert st.total == device_total(plan(sizes, s, st.part))
        names = {i.name for i in st.items}
        assert ("token embedding" in names) == (st.index == 0) == st.part.first
        assert ("output head" in names) == (st.index == len(p.stages) - 1) == st.part.last
    whole: dict[str, int] = {}
    for i in plan(sizes, s):
        whole[i.name] = i.nbytes
    summed: dict[str, int] = {}
    for st in p.stages:
        for i in st.items:
            summed[i.name] = summed.get(i.name, 0) + i.nbytes
    # one per GPU (each its own allocator: a stage's "allocator" item is prorated, plan_trace.py)
    # / once on the host
    per_model = ("workspace", "allocator", "PLE table")
    for name in set(whole) - set(per_model):
        assert summed[name] == whole[name], name
    assert summed.get("PLE table", 0) == whole.get("PLE table", 0)


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3next", "qwen4exp", *SYNTH])
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_stages_cover_every_layer_within_memory(name: str, tmp_path: Path) -> None:
    g = _file(name, tmp_path)
    costs = ModelCosts.of(g, S.cache_type_k, S.cache_type_v)
    sizes = costs.sizes
    k = min(3, sizes.spec.n_layer)
    p = stage_plan(costs, S, range(k), _free(k, 4 * GIB))
    assert len(p.stages) == k
    _check(p, sizes, S)
    for il in range(sizes.spec.n_layer):
        assert il in p.stage_of(il).part


def test_the_seed_machine_takes_five_full_contexts(flash: ModelCosts) -> None:
    """5 slots x 262144 q8_0 tokens of the full-width model over 6 x 24 GiB: every layer placed,
    the busiest stage the least a split can make it, the PLE rows going to GPU 0 (layer 1)."""
    p = stage_plan(flash, SEED, range(6), _free(6, 24 * GIB))
    _check(p, flash.sizes, SEED)
    assert p.ple_layer == 1 and p.stage_of(1).index == 0
    assert any(i.name == "PLE table" and i.host for i in p.stages[0].items)
    bal = Balance.decode_bytes(flash)
    assert max(st.load for st in p.stages) == pytest.approx(
        _brute_force(48, 6, bal.cost, lambda s, a, b: True), rel=1e-12
    )  # 24 GiB each is room enough: the unconstrained optimum
    assert p.handoff_bytes == 4 * 4 * 2560 + 8  # the HC residual: 4 streams of 2560 float32
    auto = fitted_plan(flash, dataclasses.replace(SEED, batch_size=0), range(6), _free(6, 24 * GIB))
    assert auto.settings.batch_size in (2048, 1024)  # 4096's workspace does not fit the last GPU
    assert len(auto.stages) == 6


def _brute_force(n: int, k: int, cost, fits) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        ranges = list(itertools.pairwise(bounds))
        if all(fits(i, a, b) for i, (a, b) in enumerate(ranges)):
            best = min(best, max(cost(a, b) for a, b in ranges))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_best_split_is_the_brute_force_optimum(seed: int) -> None:
    import random

    rng = random.Random(seed)
    n, k = rng.randint(4, 11), rng.randint(2, 4)
    w = [rng.uniform(1, 10) for _ in range(n)]
    room = [rng.uniform(8, 30) for _ in range(k)]

    def cost(a: int, b: int) -> float:
        return sum(w[a:b])

    def fits(i: int, a: int, b: int) -> bool:
        return sum(w[a:b]) <= room[i]

    got = best_split(n, k, cost, fits)
    want = _brute_force(n, k, cost, fits)
    if got is None:
        assert want == float("inf")
    else:
        assert max(cost(a, b) for a, b in got) == pytest.approx(want)
        assert all(fits(i, a, b) for i, (a, b) in enumerate(got))


def test_memory_moves_layers_off_a_small_gpu(flash: ModelCosts) -> None:
    free = _free(6, 24 * GIB)
    free[0] = (14 * GIB, "small")
    p = stage_plan(flash, SEED, range(6), free)
    _check(p, flash.sizes, SEED)
    roomy = stage_plan(flash, SEED, range(6), _free(6, 24 * GIB))
    assert len(p.stages[0].layers) < len(roomy.stages[0].layers)


def test_tensor_split_is_honoured(flash: ModelCosts) -> None:
    ranges = [(0, 11), (11, 22), (22, 30), (30, 33), (33, 41), (41, 48)]
    assert split_shares(48, [3, 3, 2, 1, 2, 2]) == ranges
    assert split_shares(4, [1, 100, 1]) == [(0, 1), (1, 3), (3, 4)]  # each GPU keeps a layer
    p = stage_plan(flash, SEED, range(6), _free(6, 40 * GIB), split=[3, 3, 2, 1, 2, 2])
    assert p.ranges == ranges and p.how == "--tensor-split 3,3,2,1,2,2"
    _check(p, flash.sizes, SEED)


def test_measured_times_move_layers_off_a_slow_stage(flash: ModelCosts) -> None:
    p = stage_plan(flash, SEED, range(6), _free(6, 24 * GIB))
    times = [1.0] * 6
    times[2] = 2.0  # stage 2's GPU is twice as slow as its weight bytes say
    bal = p.balance.from_times(p.ranges, times)
    assert bal.unit == "s"
    q = stage_plan(flash, SEED, range(6), _free(6, 24 * GIB), balance=bal)
    assert len(q.stages[2].layers) < len(p.stages[2].layers)
    assert q.how == "balanced by measured time"
    assert max(st.load for st in q.stages) < 2.0  # the busiest stage now takes less


def test_a_tensor_split_that_does_not_fit_names_the_gpu(flash: ModelCosts) -> None:
    with pytest.raises(StagePlanError) as e:
        stage_plan(flash, SEED, [0, 1, 2, 3, 4, 7], _free(6, 24 * GIB), split=[1, 1, 1, 1, 1, 3])
    msg = str(e.value)
    assert msg.startswith("GPU 7 (stage 5: layers ")
    assert "and the output head) needs" in msg and "give it fewer layers with --tensor-split" in msg


def test_no_split_that_fits_names_the_gpu_and_what_to_lower(flash: ModelCosts) -> None:
    free = _free(6, 20 * GIB)
    with pytest.raises(StagePlanError) as e:
        stage_plan(flash, SEED, range(6), free)
    msg = str(e.value)
    assert msg.startswith("no split of the 48 layers over 6 GPUs fits: filled in order")
    assert re.search(r"GPU 5 would need [\d.]+ GiB for layers \d+-47 and the output head", msg)
    ctx = int(re.search(r"lower --ctx-size to (\d+)", msg).group(1))  # type: ignore[union-attr]
    stage_plan(flash, dataclasses.replace(SEED, ctx_size=ctx), range(6), free)  # the advice fits
    with pytest.raises(StagePlanError, match=r"GPU 3 cannot hold even layers 0-0 and the token"):
        stage_plan(flash, SEED, [3, 4], [(GIB, "tiny"), (GIB, "tiny")])


def test_parts_sum_to_the_whole_model(flash: ModelCosts) -> None:
    sizes = flash.sizes
    parts = [Part(0, 5, True, False), Part(5, 30, False, False), Part(30, 48, False, True)]
    assert sum(sizes.state(p) for p in parts) == sizes.recurrent
    assert sum(sizes.kv(1000, "q8_0", "f16", p) for p in parts) == sizes.kv(1000, "q8_0", "f16")
    assert sum(sizes.blocks(4096, p) for p in parts) == sizes.blocks(4096)
    assert sum(sizes.weights_of(p) for p in parts) == (sizes.weights + sizes.head + sizes.embedding)
    for il, lc in enumerate(flash.layers):  # the traffic's bytes are the memory plan's
        assert lc.dense_bytes > 0 and lc.dense_bytes + lc.expert_bytes == sizes.layer_weights[il]
