"""The pipeline model (mgserve/pipeline/perfmodel.py) on cases computed by hand, and the GPU and
PCIe models (gpumodel.py) and the per-layer costs (costs.py) they read."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mgserve.pipeline.perfmodel import Link, decode, flow_shop, predict, prefill

FAST = Link(1e30)  # a link that costs nothing


def _const(times: Sequence[float]):  # type: ignore[no-untyped-def]
    return lambda *_: list(times)


def test_flow_shop_by_hand() -> None:
    # two jobs through (1, 2): job 0 leaves at 3; job 1 starts resource 0 at 1, waits for
    # resource 1 until 3, leaves at 5
    assert flow_shop([[1, 2], [1, 2]]) == [3, 5]
    assert flow_shop([[2, 1], [2, 1], [2, 1]]) == [3, 5, 7]  # the first resource paces them


def test_two_equal_stages_with_a_slow_link() -> None:
    """Stages of 1 s per chunk, a link of 2 s per chunk (100 tokens x 10 bytes at 500 B/s):
    5 chunks take 1 + 2 + 1 for the first and 2 s for each further one."""
    link = Link(bandwidth=500.0)
    r = prefill(_const([1.0, 1.0]), prompt=500, chunk=100, links=[link], handoff=10)
    assert r.seconds == pytest.approx(1 + 2 + 1 + 4 * 2)
    assert r.tokens_per_s == pytest.approx(500 / 12)
    assert r.steady_tokens_per_s == pytest.approx(100 / 2)
    assert r.fill_s == pytest.approx(4.0)
    assert r.bottleneck == "link 0 -> 1"
    with_latency = prefill(_const([1.0, 1.0]), 500, 100, [Link(500.0, 0.5)], handoff=10)
    assert with_latency.seconds == pytest.approx(1 + 2.5 + 1 + 4 * 2.5)


def test_a_bottleneck_stage_paces_the_pipe() -> None:
    n = 8
    r = prefill(_const([1.0, 3.0, 1.0]), prompt=n * 64, chunk=64, links=[FAST, FAST], handoff=1)
    assert r.seconds == pytest.approx(5 + (n - 1) * 3)
    assert r.steady_tokens_per_s == pytest.approx(64 / 3)
    assert r.bottleneck == "stage 1"
    assert r.busy[r.names.index("stage 1")] == pytest.approx(n * 3 / r.seconds)


def test_fill_and_drain_of_a_short_prompt() -> None:
    """3 stages of 1 s: a 2-chunk prompt takes 4 s (3 to fill, 1 more): half the steady rate of
    a chunk per second; a long prompt comes near it."""
    r = prefill(_const([1.0, 1.0, 1.0]), prompt=200, chunk=100, links=[FAST, FAST], handoff=1)
    assert r.seconds == pytest.approx(4.0)
    assert r.tokens_per_s == pytest.approx(50.0) and r.steady_tokens_per_s == pytest.approx(100)
    long = prefill(_const([1.0, 1.0, 1.0]), prompt=100_000, chunk=100, links=[FAST, FAST],
                   handoff=1)  # fmt: skip
    assert long.tokens_per_s == pytest.approx(100 * 1000 / 1002)  # fill and drain amortised
    last = prefill(_const([1.0]), prompt=250, chunk=100, links=[], handoff=1)
    assert last.seconds == pytest.approx(3.0)  # a short last chunk still costs its stage time


def test_chunk_times_follow_depth() -> None:
    seen = []

    def times(tokens: int, depth: int) -> list[float]:
        seen.append((tokens, depth))
        return [1.0]

    prefill(times, prompt=250, chunk=100, links=[], handoff=1)
    assert seen == [(100, 0), (100, 100), (50, 200)]


def test_host_link_feeds_the_first_stage() -> None:
    host = Link(bandwidth=100.0, latency=0.25)  # 1 s of bytes per 100-token chunk + latency
    r = prefill(_const([0.5]), prompt=300, chunk=100, links=[], handoff=0, host=host,
                host_bytes=1)  # fmt: skip
    assert r.names == ("host -> stage 0", "stage 0")
    assert r.seconds == pytest.approx(1.25 + 0.5 + 2 * 1.25)
    assert r.bottleneck == "host -> stage 0"


def test_decode_one_session_is_the_ring_latency() -> None:
    link = Link(bandwidth=1000.0, latency=0.001)  # 10 bytes: 0.011 s
    r = decode(lambda b: [0.01, 0.02, 0.03], 1, 1, [link, link], handoff=10, loop_s=0.004)
    assert r.latency_s == pytest.approx(0.06 + 2 * 0.011 + 0.004)
    assert r.cycle_s == r.latency_s and r.per_session_tps == pytest.approx(1 / r.latency_s)
    assert r.bottleneck == "latency"


def test_decode_sessions_in_flight() -> None:
    """6 equal stages of t: 5 sessions as 5 micro-batches fill 5/6 of the ring, so each still
    gets a token per 6 t; 12 micro-batches overfill it and the slowest stage paces them."""
    t, six = 0.01, [FAST] * 5
    r5 = decode(lambda b: [t] * 6, 5, 5, six, handoff=1)
    assert r5.cycle_s == pytest.approx(6 * t) and r5.aggregate_tps == pytest.approx(5 / (6 * t))
    r12 = decode(lambda b: [t] * 6, 12, 12, six, handoff=1)
    assert r12.cycle_s == pytest.approx(12 * t) and r12.aggregate_tps == pytest.approx(1 / t)
    assert r12.bottleneck == "stage 0"
    slow = decode(lambda b: [t, t, 3 * t, t, t, t], 5, 5, six, handoff=1)
    assert slow.cycle_s == pytest.approx(15 * t)  # 5 x the bottleneck stage > 8 t around
    one_batch = decode(lambda b: [t * b**0.5] * 6, 4, 1, six, handoff=1)
    assert one_batch.cycle_s == pytest.approx(6 * t * 2)  # 4 sessions in one step of sqrt(4) t


def test_predict_takes_the_best_grouping() -> None:
    def step(b: int, depth: int) -> list[float]:
        return [0.01 + 0.001 * b] * 2  # weights once per step, a little per session

    p = predict(_const([1.0, 1.0]), step, [FAST], 1, prompt=100, chunk=100, depth=0,
                sessions=[1, 4])  # fmt: skip
    assert [d.sessions for d in p.decode] == [1, 4]
    assert p.decode_each[1].micro_batches == 4
    # 4 micro-batches of 1: 2 stages busy at once, cycle max(0.022, 4 x 0.011) = 0.044;
    # 2 of 2: max(0.024, 2 x 0.012) = 0.024; 1 of 4: 0.028: two of two wins
    assert p.decode[1].micro_batches == 2 and p.decode[1].cycle_s == pytest.approx(0.024)
    assert p.decode_each[1].cycle_s == pytest.approx(0.044)


def test_pcie_hops() -> None:
    from mgserve.pipeline.gpumodel import PcieModel

    gen4 = PcieModel(gen=4, lane_eff=1.0, latency_us=10.0)
    x8, x2 = gen4.host_link(8), gen4.host_link(2)
    assert x8.bandwidth == pytest.approx(8 * 1.969e9)
    hop = gen4.hop(8, 2)  # staged: the two copies' times add
    nbytes = 1e6
    assert hop.time(nbytes) == pytest.approx(x8.time(nbytes) + x2.time(nbytes))
    p2p = PcieModel(gen=4, lane_eff=1.0, latency_us=10.0, p2p=True).hop(8, 2)
    assert p2p.time(nbytes) == pytest.approx(x2.time(nbytes))
    assert len(gen4.hops([8, 8, 4, 2, 4, 4])) == 5
    with pytest.raises(ValueError, match="PCIe gen"):
        PcieModel(gen=2).lane_rate()


def test_check_run_predicts_a_run_from_its_stage_times() -> None:
    """From measured busy seconds: prefill as a flow shop of chunks (two balanced stages of 1 s
    a chunk, 8 chunks: 9 s), decode as a flow shop of one step's micro-batches (what lockstep
    runs; the next step waits for this one), links and host free."""
    from mgserve.pipeline.perfmodel import check_run

    tps, step_s = check_run([8.0, 8.0], 2048, 256, [1.0, 1.0], 10, 4, 1)
    assert tps == pytest.approx(2048 / 9) and step_s == pytest.approx(0.2)
    _, step_s = check_run([8.0, 8.0], 2048, 256, [1.0, 1.0], 10, 4, 2)
    assert step_s == pytest.approx(0.15)  # halves: 0.05 + 0.05 overlapped + 0.05
    tps, _ = check_run([8.0, 4.0], 2048, 256, [1.0, 1.0], 10, 4, 1)
    assert tps == pytest.approx(2048 / 8.5)  # the busy stage sets the pace, the other drains


def test_check_run_gives_a_short_last_chunk_its_share_of_the_measured_busy() -> None:
    """A prompt of 300 tokens in chunks of 128 (128, 128, 44): one stage that measured 3 s over
    it takes 3 s in the model, not 3 s less what the last chunk is short of a full one's."""
    from mgserve.pipeline.perfmodel import check_run

    tps, _ = check_run([3.0], 300, 128, [1.0], 10, 1, 1)
    assert tps == pytest.approx(300 / 3.0)
