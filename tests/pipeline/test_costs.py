"""Per-layer traffic (mgserve/pipeline/costs.py) and the GPU roofline (gpumodel.py) on the tiny
qwen4exp and gemma3 exports: what grows with depth and batch, and what does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgserve.cuda.plan import Part
from mgserve.pipeline.costs import ModelCosts
from mgserve.pipeline.gpumodel import GpuModel
from tests.cuda.test_plan import _file


@pytest.fixture(scope="module")
def q4x(tmp_path_factory: pytest.TempPathFactory) -> ModelCosts:
    return ModelCosts.of(_file("qwen4exp", tmp_path_factory.mktemp("q4x")), "q8_0", "f16")


def test_expert_share_of_a_step(q4x: ModelCosts) -> None:
    hp = q4x.sizes.hp
    assert hp is not None and q4x.expert_share == hp.n_expert_used / hp.n_expert
    for il, lc in enumerate(q4x.layers):
        assert lc.expert_bytes > 0
        one = lc.dense_bytes + lc.expert_bytes * q4x.expert_share
        assert q4x.weight_read(il, 1) == pytest.approx(one)
        assert q4x.weight_read(il, 10_000) == pytest.approx(lc.dense_bytes + lc.expert_bytes)


def test_what_grows_with_depth(q4x: ModelCosts) -> None:
    qp = q4x.sizes.qp
    assert qp is not None
    kinds = [lc.kind for lc in q4x.layers]
    assert set(kinds) == {"recurrent", "qsa"}
    rec, qsa = kinds.index("recurrent"), kinds.index("qsa")
    assert q4x.session_bytes(rec, 10) == q4x.session_bytes(rec, 10**6) == 2 * q4x.state_bytes
    cells = qp.idx_budget + qp.ratio - 1  # past the budget only the block keys grow
    far, farther = 1000 * qp.ratio, 2000 * qp.ratio
    grow = q4x.session_bytes(qsa, farther) - q4x.session_bytes(qsa, far)
    assert grow == 1000 * qp.idx_dim * 4
    assert q4x.session_bytes(qsa, 8) == 8 * q4x.kv_cell + 2 * qp.idx_dim * 4
    assert q4x.session_bytes(qsa, far) == cells * q4x.kv_cell + 1000 * qp.idx_dim * 4
    spec = q4x.sizes.spec
    assert q4x.handoff_bytes == 4 * qp.hc * spec.n_embd + 8  # never O(context)


def test_dense_attention_reads_every_cell(tmp_path: Path) -> None:
    g3 = ModelCosts.of(_file("gemma3", tmp_path), "f16", "f16")
    spec = g3.sizes.spec
    full = [il for il, lc in enumerate(g3.layers) if lc.kind == "attention"]
    swa = [il for il, lc in enumerate(g3.layers) if lc.kind == "swa"]
    assert full and swa and g3.expert_share == 0
    assert g3.session_bytes(full[0], 5000) == 5000 * g3.kv_cell == 5000 * 2 * 2 * spec.kv_dim
    assert g3.session_bytes(swa[0], 10**6) == spec.sliding_window * g3.kv_cell
    assert g3.handoff_bytes == 4 * spec.n_embd + 8


def test_decode_step_is_bytes_over_bandwidth_when_flops_are_free(q4x: ModelCosts) -> None:
    gpu = GpuModel(bandwidth_gbps=100.0, bandwidth_eff=0.5, tflops=1e9, layer_overhead_us=7.0)
    n, depth = len(q4x.layers), 4096
    nbytes = sum(q4x.weight_read(il, 2) + 2 * q4x.session_bytes(il, depth) for il in range(n))
    want = (nbytes + q4x.head_bytes) / 50e9 + n * 7e-6
    assert gpu.decode_step(q4x, Part(0, n), 2, depth) == pytest.approx(want)
    first, rest = Part(0, 3, True, False), Part(3, n, False, True)
    split = gpu.decode_step(q4x, first, 2, depth) + gpu.decode_step(q4x, rest, 2, depth)
    assert split == pytest.approx(want)  # stages add up to the whole; the head on the last


def test_prefill_is_flops_bound_on_a_slow_gpu(q4x: ModelCosts) -> None:
    gpu = GpuModel(bandwidth_gbps=1e9, tflops=1e-3, flops_eff=1.0, layer_overhead_us=0.0)
    n, tokens = len(q4x.layers), 64
    t = gpu.prefill_chunk(q4x, Part(0, n), tokens, 0)
    flops = sum(tokens * (q4x.token_flops(il) + q4x.session_flops(il, tokens // 2))
                for il in range(n))  # fmt: skip
    assert t == pytest.approx(flops / 1e9, rel=1e-6)
