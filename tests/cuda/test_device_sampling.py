"""The device sampler (mgserve/cuda/sampling/) against the CPU sampler
(mgserve/core/engine/sampling.py).

CPU tests (run in CI): the biased/penalized logits equal SeqSampler's bit for bit, greedy picks
SeqSampler's token, the filters keep SeqSampler's candidate sets, the draw depends only on
(seed, counter, logits, params) and follows softmax(filtered / T), logprobs equal logprobs_for.
GPU tests (marked): the same results on the device, and a CUDA-graph capture (no host sync).
"""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.engine.sampling import (
    SeqSampler,
    apply_logit_bias,
    apply_penalties,
    filter_candidates,
    logprobs_for,
)
from mgserve.cuda.sampling import (
    SORT,
    WHOLE,
    DeviceSampler,
    HostBuffers,
    SamplingBatch,
    SamplingPlan,
    SamplingRow,
    seeded,
)
from mgserve.cuda.sampling.chain import filter_candidates_batch, modified_logits
from mgserve.cuda.sampling.rng import row_keys, splitmix64, splitmix64_int, uniforms

CPU = torch.device("cpu")
SAMPLER = DeviceSampler()


def rand_logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale  # [B, V]


def rand_history(n: int, v: int, seed: int) -> list[int]:
    """n tokens from a small pool of ids (so some repeat), plus the odd out-of-vocabulary one."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, v, (max(n // 3, 1),), generator=g)
    toks = pool[torch.randint(0, pool.numel(), (n,), generator=g)].tolist()
    if n > 4:
        toks[2] = v + 7  # counted by SeqSampler's window but outside the vocabulary
    return toks


def reference_modified(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """SeqSampler's biased, penalized row [V]."""
    s = SeqSampler(p, history)
    x = logits.float().clone()
    apply_logit_bias(x, p.logit_bias)
    apply_penalties(x, s.window.counts, p)
    return x


# --------------------------------------------------------------------------------------------
# the hash


def test_splitmix64_matches_python_oracle() -> None:
    vals = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321, 0x9E3779B97F4A7C15 - 2**64]
    got = splitmix64(torch.tensor(vals, dtype=torch.int64)).tolist()
    for z, h in zip(vals, got, strict=True):
        assert h % 2**64 == splitmix64_int(z), (z, h)


def test_uniforms_in_open_interval_and_depend_on_every_input() -> None:
    key = row_keys(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]))  # [3]
    u = uniforms(key, torch.arange(1000)[None, :])  # [3, 1000]
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(float(u.mean()) - 0.5) < 0.03
    # same (seed, counter, id) -> same number, whatever else is in the call
    u2 = uniforms(key[1:2], torch.tensor([[999, 3]]))
    assert u2[0, 0] == u[1, 999] and u2[0, 1] == u[1, 3]


# --------------------------------------------------------------------------------------------
# bias, penalties, greedy

PENALTY_CASES = [
    # (params, history length)
    (SamplingParams(temperature=0.0), 0),
    (SamplingParams(temperature=0.0, repeat_penalty=1.3), 40),
    (SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=8), 40),
    (SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4), 100),
    (
        SamplingParams(
            temperature=0.0, repeat_penalty=1.2, frequency_penalty=0.3, repeat_last_n=-1
        ),
        700,  # whole context: > COUNT_BY_COMPARE_MAX_W, counted by the [B, V] histogram
    ),
    (SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=0), 50),  # window off
    (
        SamplingParams(
            temperature=0.0,
            repeat_penalty=1.2,
            logit_bias=((3, 2.5), (17, -float("inf")), (900, 1.0), (10**6, 5.0)),
        ),
        30,
    ),
]


@pytest.mark.parametrize("mixed", [False, True])
def test_modified_logits_and_greedy_equal_seqsampler(mixed: bool) -> None:
    v = 1000
    logits = rand_logits(len(PENALTY_CASES), v, seed=1)
    hists = [rand_history(n, v, seed=10 + i) for i, (_, n) in enumerate(PENALTY_CASES)]
    params = [seeded(p) for p, _ in PENALTY_CASES]
    if mixed:  # the same rows in one batch
        groups = [list(range(len(params)))]
    else:  # each row alone
        groups = [[i] for i in range(len(params))]
    for rows in groups:
        batch = SamplingBatch.build([(params[i], hists[i], 0) for i in rows], v, CPU)
        x = modified_logits(logits[rows], batch, batch.plan)
        out = SAMPLER.sample(logits[rows], batch)
        for j, i in enumerate(rows):
            ref = reference_modified(logits[i], params[i], hists[i])
            assert torch.equal(x[j], ref), (
                f"row {i}: max diff {(x[j] - ref).abs().max()} at {(x[j] - ref).abs().argmax()}"
            )
            want = SeqSampler(params[i], hists[i]).sample(logits[i])
            assert int(out.tokens[j]) == want, (i, int(out.tokens[j]), want)


def test_greedy_banned_tokens_and_ties_to_lowest_id() -> None:
    v = 50
    logits = torch.zeros(3, v)
    logits[:, [7, 9, 30]] = 4.0  # a three-way tie
    bans = tuple((t, -float("inf")) for t in (7, 8))
    params = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=0.0, seed=1, logit_bias=bans),
        SamplingParams(temperature=-1.0, seed=1, logit_bias=((9, -float("inf")), (9, 1.0))),
    ]
    out = SAMPLER.sample(logits, SamplingBatch.build([(p, [], 0) for p in params], v, CPU))
    assert out.tokens.tolist() == [7, 9, 7]
    for i, p in enumerate(params):
        assert SeqSampler(p).sample(logits[i]) == out.tokens[i]


def test_top_k_1_is_greedy() -> None:
    v = 3000
    logits = rand_logits(1, v, seed=2).expand(64, v)
    p = SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=3)
    batch = SamplingBatch.build([(p, [], c) for c in range(64)], v, CPU)
    out = SAMPLER.sample(logits.contiguous(), batch)
    assert bool((out.tokens == logits[0].argmax()).all()), out.tokens.unique()


# --------------------------------------------------------------------------------------------
# the filters

FILTER_PARAMS = [
    SamplingParams(),  # llama.cpp defaults: top_k 40, top_p 0.95, min_p 0.05
    SamplingParams(top_k=0, top_p=0.9, min_p=0.0),
    SamplingParams(top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(top_k=200, top_p=0.5, min_p=0.0),
    SamplingParams(top_k=7, top_p=1.0, min_p=0.0),
    SamplingParams(top_k=0, top_p=0.99, min_p=0.02, temperature=1.3),
    SamplingParams(top_k=50, top_p=1.0, min_p=0.3),
    SamplingParams(top_k=0, top_p=1.0, min_p=0.0),  # nothing filtered
    SamplingParams(top_k=10**6, top_p=0.8, min_p=0.0),  # top_k >= V is off
    SamplingParams(top_k=5, top_p=0.001, min_p=0.0),  # top_p keeps only the first
    SamplingParams(top_k=0, top_p=1.0, min_p=2.0),  # min_p > 1 keeps only the first
]


def kept_sets(logits: torch.Tensor, batch: SamplingBatch) -> list[set[int]]:
    x = modified_logits(logits, batch, batch.plan)
    ids, _, keep = filter_candidates_batch(x, batch, batch.plan)
    ids = ids.expand(keep.shape)
    return [set(ids[i][keep[i]].tolist()) for i in range(keep.shape[0])]


@pytest.mark.parametrize("mixed", [False, True])
def test_filters_keep_seqsamplers_candidates(mixed: bool) -> None:
    v = 5000
    logits = rand_logits(len(FILTER_PARAMS), v, seed=4, scale=2.0)
    params = [seeded(p) for p in FILTER_PARAMS]
    groups = [list(range(len(params)))] if mixed else [[i] for i in range(len(params))]
    for rows in groups:
        batch = SamplingBatch.build([(params[i], [], 0) for i in rows], v, CPU)
        got = kept_sets(logits[rows], batch)
        for j, i in enumerate(rows):
            want = set(filter_candidates(logits[i].clone(), params[i])[0].tolist())
            assert got[j] == want, (
                f"row {i} {params[i]} plan {batch.plan}: kept {len(got[j])}, SeqSampler "
                f"{len(want)}; only here {sorted(got[j] - want)[:5]}, "
                f"only there {sorted(want - got[j])[:5]}"
            )


def test_plan_choice() -> None:
    v = 100

    def plan(*ps: SamplingParams) -> SamplingPlan:
        return SamplingBatch.build([(seeded(p), [], 0) for p in ps], v, CPU).plan

    greedy = SamplingParams(temperature=0.0)
    assert plan(greedy).candidates == 0
    assert plan(greedy, SamplingParams(top_k=40), SamplingParams(top_k=7)).candidates == 40
    assert plan(SamplingParams(top_k=0, top_p=0.9)).candidates == SORT
    assert plan(SamplingParams(top_k=0, top_p=1.0), SamplingParams(top_k=5)).candidates == SORT
    assert plan(SamplingParams(top_k=0, top_p=1.0, min_p=0.1)).candidates == WHOLE
    assert plan(SamplingParams(top_k=100, top_p=1.0)).candidates == WHOLE  # top_k >= V: off
    p = plan(SamplingParams(n_probs=5), SamplingParams(want_logprob=True, repeat_penalty=1.1))
    assert (p.n_top, p.logprob, p.penalties, p.bias) == (5, True, False, False)


# --------------------------------------------------------------------------------------------
# the draw


def draws(
    logits_row: torch.Tensor,
    p: SamplingParams,
    counters: range,
    others: list[SamplingParams] = (),  # type: ignore[assignment]
) -> list[int]:
    """The tokens of one session for each counter, with ``others`` sharing every step."""
    v = logits_row.shape[0]
    out = []
    for c in counters:
        rows = [(p, [], c)] + [(o, [], c + 1000) for o in others]
        logits = torch.cat([logits_row[None], rand_logits(len(others), v, seed=c)])
        out.append(int(SAMPLER.sample(logits, SamplingBatch.build(rows, v, CPU)).tokens[0]))
    return out


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=1.0, seed=42),  # topk mode alone
        SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.01, seed=7),  # WHOLE alone
        SamplingParams(temperature=0.9, top_k=0, top_p=0.97, min_p=0.0, seed=-5),  # SORT
    ],
)
def test_draw_independent_of_batch_and_varies_with_counter(p: SamplingParams) -> None:
    v = 2000
    row = rand_logits(1, v, seed=5, scale=1.0)[0]
    others = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(top_k=0, top_p=0.8, seed=2),  # forces a whole-row sort
        SamplingParams(top_k=300, top_p=1.0, seed=3, repeat_penalty=1.3, n_probs=3),
    ]
    alone = draws(row, p, range(40))
    assert draws(row, p, range(40), others) == alone
    assert draws(row, p, range(40), others[::-1]) == alone
    assert len(set(alone)) > 10, alone  # different counters, different draws
    other_seed = draws(row, SamplingParams(**{**p.__dict__, "seed": p.seed + 1}), range(40))
    assert other_seed != alone


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.5, top_k=0, top_p=0.95, min_p=0.0),
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5),
    ],
)
def test_draw_frequencies_follow_filtered_softmax(p: SamplingParams) -> None:
    """n draws at counters 0..n-1 against softmax(filter_candidates(...) / T): a chi-square
    test with a generous bound (a fixed seed, so the outcome is deterministic)."""
    v, n = 24, 20000
    row = rand_logits(1, v, seed=6, scale=1.5)[0]
    hist = [3, 3, 5, 1]
    p = SamplingParams(**{**p.__dict__, "seed": 1234})
    batch = SamplingBatch.build([(p, hist, c) for c in range(n)], v, CPU)
    tokens = SAMPLER.sample(row.expand(n, v).contiguous(), batch).tokens
    x = reference_modified(row, p, hist)
    ids, vals = filter_candidates(x, p)
    probs = torch.softmax(vals.double() / p.temperature, dim=0)
    counts = torch.bincount(tokens.long(), minlength=v).double()
    assert counts.sum() == counts[ids].sum(), "a filtered-out token was drawn"
    expected = probs * n
    chi2 = float(((counts[ids] - expected) ** 2 / expected).sum())
    df = max(len(ids) - 1, 1)
    bound = df + 6 * math.sqrt(2 * df) + 10
    assert chi2 < bound, f"chi2 {chi2:.1f} (df {df}); counts {counts[ids].tolist()}"


# --------------------------------------------------------------------------------------------
# logprobs, batches, host buffers


def test_logprobs_and_top_equal_logprobs_for() -> None:
    v = 4000
    params = [
        SamplingParams(seed=1, want_logprob=True, n_probs=5),
        SamplingParams(seed=2),
        SamplingParams(seed=3, temperature=0.0, n_probs=2, logit_bias=((0, 50.0),)),
        SamplingParams(seed=4, want_logprob=True, repeat_penalty=1.4),
    ]
    logits = rand_logits(len(params), v, seed=8)
    batch = SamplingBatch.build([(p, [1, 2, 3], 5) for p in params], v, CPU)
    out = SAMPLER.sample(logits, batch)
    assert out.logprob is not None and out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (4, 5)
    ref = logprobs_for(logits, out.tokens.tolist(), params)
    for i, (lp, top) in enumerate(ref):
        if lp is not None:
            assert float(out.logprob[i]) == lp, (i, float(out.logprob[i]), lp)
        n = batch.host_n_probs[i]
        assert [(t.token, t.logprob) for t in top] == list(
            zip(out.top_ids[i, :n].tolist(), out.top_logprobs[i, :n].tolist(), strict=True)
        )
    assert int(out.tokens[2]) == 0


def test_preallocated_batch_matches_built_batch() -> None:
    v = 3000
    rows = [
        SamplingRow(SamplingParams(seed=1, repeat_penalty=1.2), [4, 4, 9], 3),
        SamplingRow(SamplingParams(temperature=0.0), [], 0, seed=77),
        SamplingRow(SamplingParams(top_k=0, top_p=0.9, logit_bias=((5, 1.0),)), [1], 9, seed=2),
    ]
    logits = rand_logits(8, v, seed=9)
    fixed = SamplingBatch.allocate(8, v, CPU, max_window=16, max_bias=4)
    raw = fixed._raw
    for step in range(2):
        rs = rows if step == 0 else rows[:2]
        built = SamplingBatch.build(rs, v, CPU)
        want = SAMPLER.sample(logits[: len(rs)], built).tokens
        got8 = SAMPLER.sample(logits, SamplingBatch.build(rs, v, CPU, out=fixed)).tokens
        got_n = SAMPLER.sample(logits[: len(rs)], fixed).tokens
        broad = SAMPLER.sample(logits, fixed, SamplingPlan.broad()).tokens
        assert torch.equal(got8[: len(rs)], want) and torch.equal(got_n, want), (got8, want)
        assert torch.equal(broad[: len(rs)], want), (broad, want)
        assert fixed._raw is raw and fixed.n_rows == len(rs)
    # the row the second fill dropped is neutral again in the device buffer (its staging views
    # are made once and reused, so every fill resets them)
    assert float(fixed.top_p[2]) == float("inf") and int(fixed.bias_ids[2].abs().sum()) == 0
    assert bool(fixed.greedy[2]) and float(fixed.bias_values[2].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="capacity"):
        fixed.update([rows[0]] * 9)
    with pytest.raises(ValueError, match="window"):
        fixed.update([SamplingRow(SamplingParams(seed=1), list(range(20)), 0)])
    with pytest.raises(ValueError, match="rows"):
        SAMPLER.sample(logits[:1], fixed)  # fewer logits rows than live rows


def test_to_host_and_validation() -> None:
    v = 100
    p = SamplingParams(seed=1, want_logprob=True, n_probs=3)
    batch = SamplingBatch.build([(p, [], 0), (p, [], 1)], v, CPU)
    logits = rand_logits(2, v, seed=11)
    out = SAMPLER.sample(logits, batch)
    buf = HostBuffers.allocate(8, 4)
    host = out.to_host(buf)
    assert host.tokens.tolist() == out.tokens.tolist()
    assert host.logprob is not None and torch.equal(host.logprob, out.logprob)
    assert host.top_ids is not None and torch.equal(host.top_ids, out.top_ids)
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.build([(SamplingParams(), [], 0)], v, CPU)
    with pytest.raises(ValueError, match="V="):
        SAMPLER.sample(rand_logits(2, v + 1), batch)
    with pytest.raises(ValueError, match="float32"):
        SAMPLER.sample(logits.double(), batch)
    assert seeded(SamplingParams()).seed is not None and seeded(p) is p


# --------------------------------------------------------------------------------------------
# GPU

GPU_PARAMS = [
    SamplingParams(seed=1, want_logprob=True, n_probs=4),
    SamplingParams(temperature=0.0, repeat_penalty=1.3, logit_bias=((11, -float("inf")),)),
    SamplingParams(seed=3, top_k=0, top_p=0.9, min_p=0.0, frequency_penalty=0.5),
    SamplingParams(seed=4, top_k=0, top_p=1.0, min_p=0.05, temperature=1.2),
    SamplingParams(seed=5, top_k=100, top_p=0.95, min_p=0.05, repeat_last_n=-1),
    SamplingParams(seed=6, temperature=0.6, presence_penalty=0.8, want_logprob=True),
    SamplingParams(seed=7, top_k=1),
    SamplingParams(seed=8, temperature=1.0, top_k=40, logit_bias=((2, 3.0), (2, 1.0))),
]


def gpu_rows(v: int, step: int) -> list[SamplingRow]:
    return [
        SamplingRow(seeded(p), rand_history(300 if p.repeat_last_n < 0 else 64, v, seed=i), step)
        for i, p in enumerate(GPU_PARAMS)
    ]


@pytest.mark.gpu
def test_gpu_matches_cpu_full_vocab() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    v = 248320
    dev = torch.device("cuda")
    logits = rand_logits(len(GPU_PARAMS), v, seed=12, scale=4.0)
    rows = gpu_rows(v, 3)
    cpu = SAMPLER.sample(logits, SamplingBatch.build(rows, v, CPU))
    gpu = SAMPLER.sample(logits.to(dev), SamplingBatch.build(rows, v, dev))
    torch.cuda.synchronize()
    assert gpu.tokens.tolist() == cpu.tokens.tolist(), (gpu.tokens.tolist(), cpu.tokens.tolist())
    for name in ("logprob", "top_logprobs"):
        a, b = getattr(gpu, name).cpu(), getattr(cpu, name)
        err = float((a - b).abs().max())
        assert err < 1e-4, f"{name}: max error {err}"
    assert torch.equal(gpu.top_ids.cpu(), cpu.top_ids)
    # the hash is the same on the device
    seed = torch.tensor([1, -2, 2**62], dtype=torch.int64)
    ids = torch.arange(1000)[None, :]
    key = row_keys(seed, seed * 3)
    assert torch.equal(uniforms(key.to(dev), ids.to(dev)).cpu(), uniforms(key, ids))


@pytest.mark.gpu
def test_gpu_graph_capture_and_speed() -> None:
    """sample() captures into a CUDA graph (so it never syncs) and a refilled batch replays it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    v, b = 248320, len(GPU_PARAMS)
    dev = torch.device("cuda")
    logits = rand_logits(b, v, seed=13, scale=4.0).to(dev)
    fixed = SamplingBatch.allocate(b, v, dev, max_window=512, max_bias=4)
    fixed.update(gpu_rows(v, 0))
    plan = SamplingPlan.broad(n_top=4, logprob=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            SAMPLER.sample(logits, fixed, plan)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SAMPLER.sample(logits, fixed, plan)
    for step in (5, 6):
        fixed.update(gpu_rows(v, step))
        graph.replay()
        eager = SAMPLER.sample(logits, fixed, plan)
        host = out.to_host(HostBuffers.allocate(b, 4, pin=True))
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert host.tokens.tolist() == eager.tokens.tolist(), step
    # timing (informational): eager, own plan vs broad, and the graph
    for name, fn in [
        ("eager own plan", lambda: SAMPLER.sample(logits, fixed)),
        ("eager broad", lambda: SAMPLER.sample(logits, fixed, plan)),
        ("graph broad", graph.replay),
    ]:
        fn()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(20):
            fn()
        t1.record()
        t1.synchronize()
        print(f"sampling B={b} V={v} {name}: {t0.elapsed_time(t1) / 20 * 1000:.0f} us")
