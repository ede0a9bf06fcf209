"""``bench model --gaps``'s costs (bench/model/costs.py) and their tally (figures.py): the bytes
and flops of op family calls on real ``QuantWeight``s and tensors, the hand-off of a call's cost
to the costed calls inside it, and the cost functions run on a tiny model's real calls."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mgserve.bench.model.costs import COSTS, Cost, combine_mix, experts, matmul, matvec, mix
from mgserve.bench.model.costs import prefill as attention_prefill
from mgserve.bench.model.figures import Rates, Tally, cells, nominal_peak
from mgserve.cuda.ops.moe import ExpertWeights
from mgserve.cuda.pools import kv_layer
from mgserve.cuda.weights import QuantWeight, upload_bytes


def _w(type_name: str, shape: tuple[int, ...], row_bytes: int) -> QuantWeight:
    rows = int(np.prod(shape[1:]))
    raw = np.zeros(rows * row_bytes, np.uint8)
    return upload_bytes(f"w.{type_name}", type_name, shape, raw, device="cpu")


def _f32(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32)


def test_cost_functions_take_each_methods_arguments() -> None:
    """A cost function is called with the method's own arguments: the same names, order and
    kinds as the CUDA class's method and its torch twin's (where the twin has it)."""
    from mgserve.cuda.ops.attention import AttentionTorch
    from mgserve.cuda.ops.attention_cuda import AttentionCuda
    from mgserve.cuda.ops.deltanet import DeltaNetTorch
    from mgserve.cuda.ops.deltanet_cuda import DeltaNetCuda
    from mgserve.cuda.ops.hc import HCTorch
    from mgserve.cuda.ops.hc_cuda import HCCuda
    from mgserve.cuda.ops.linear import LinearTorch
    from mgserve.cuda.ops.linear_cuda import LinearCuda
    from mgserve.cuda.ops.moe import MoeTorch
    from mgserve.cuda.ops.moe_cuda import MoeCuda
    from mgserve.cuda.ops.norm import NormCuda, NormTorch

    classes = {
        "linear": (LinearCuda, LinearTorch),
        "moe": (MoeCuda, MoeTorch),
        "hc": (HCCuda, HCTorch),
        "norm": (NormCuda, NormTorch),
        "attention": (AttentionCuda, AttentionTorch),
        "deltanet": (DeltaNetCuda, DeltaNetTorch),
    }

    def params(f: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]

    checked = 0
    for label, fn in COSTS.items():
        fam, method = label.split(".")
        for cls in classes[fam]:
            if hasattr(cls, method):
                assert params(getattr(cls, method))[1:] == params(fn), (label, cls.__name__)
                checked += 1
    assert checked >= len(COSTS) + 8  # the CUDA classes have every method, most twins too


def test_products_count_the_weights_stored_bytes_and_2mnk_flops() -> None:
    w = _w("Q4_K", (512, 3), 288)  # 3 rows of 512 values: 2 blocks of 144 bytes a row
    assert w.nbytes == 864
    # W, x [512] f32, y [3] f32; 2 x 3 x 512 flops
    assert matvec(w, _f32(512)) == Cost(864 + 2048 + 12, 3072)
    bias, res = _f32(3), _f32(16, 3)
    # a 16-token prompt: W once, x [16, 512], bias, residual and y [16, 3] f32
    assert matmul(_f32(16, 512), w, bias=bias, residual=res) == Cost(
        864 + 32768 + 12 + 192 + 192, 2 * 16 * 3 * 512
    )
    assert matmul(_f32(0, 512), w) == Cost(0.0, 0.0)  # no rows: W is not read


def test_moe_experts_count_k_experts_weights_and_every_tokens_flops() -> None:
    d, ff, e = 64, 32, 4  # Q8_0: 34 bytes per 32 values
    gate, up = _w("Q8_0", (d, ff, e), 68), _w("Q8_0", (d, ff, e), 68)
    down = _w("Q8_0", (ff, d, e), 34)
    ew = ExpertWeights(gate, up, None, down, e, ff)
    assert gate.nbytes == up.nbytes == down.nbytes == 8704  # 6528 bytes per expert
    ids = torch.zeros(1, 2, dtype=torch.int32)
    one = experts(_f32(1, d), ew, ids, _f32(1, 2))
    # 2 of the 4 experts, x [1, 64], ids and weights [1, 2], out [1, 64]; 2 x 2 x 3 d ff
    assert one == Cost(2 * 6528 + 256 + 8 + 8 + 256, 2 * 2 * 3 * d * ff)
    three = experts(_f32(3, d), ew, torch.zeros(3, 2, dtype=torch.int32), _f32(3, 2),
                    residual=_f32(3, d))  # fmt: skip
    # still the 2 experts certainly read; flops of all 3 tokens
    assert three == Cost(2 * 6528 + 768 + 24 + 24 + 768 + 768, 3 * 2 * 2 * 3 * d * ff)


def test_hc_mix_reads_down_up_inject_once() -> None:
    n, hc, d, r = 2, 4, 32, 32
    down = _w("Q8_0", (hc * d, r), 4 * 34)  # [r, hc d]
    up = _w("Q8_0", (r, hc * d), 34)  # [hc d, r]
    inject = _w("Q8_0", (hc * d, hc), 4 * 34)  # [hc, hc d]
    wb = down.nbytes + up.nbytes + inject.nbytes
    assert wb == 32 * 136 + 128 * 34 + 4 * 136
    x, norm = _f32(n, hc, d), _f32(hc, d)
    macs = r * hc * d + hc * d * r + hc * hc * d
    # x [2, 4, 32] and norm [4, 32] in, mixed [2, 32] and inject [2, 4] out
    assert mix(x, norm, down, up, inject, 1e-6) == Cost(wb + 1024 + 512 + 256 + 32, 2 * n * macs)
    assert mix(x, norm, down, up, None, 1e-6).bytes == wb - inject.nbytes + 1024 + 512 + 256
    # combine first: the previous out [2, 32] and inject [2, 4] in, the new x out
    cm = combine_mix(x, _f32(n, d), _f32(n, hc), norm, down, up, inject, 1e-6)
    assert cm == Cost(wb + 1024 + 512 + 256 + 32 + 256 + 32 + 1024, 2 * n * macs)


@pytest.mark.parametrize(
    ("start", "t", "window", "keys", "pairs"),
    [
        (0, 4, 0, 4, 1 + 2 + 3 + 4),
        (10, 2, 0, 12, 11 + 12),
        (2, 4, 3, 6, 3 + 3 + 3 + 3),  # positions 2..5 see 3 keys each, keys 0..5 read
        (0, 5, 3, 5, 1 + 2 + 3 + 3 + 3),
        (6, 2, 4, 5, 4 + 4),  # keys 3..7
    ],
)
def test_attention_prefill_reads_the_visible_keys_once(
    start: int, t: int, window: int, keys: int, pairs: int
) -> None:
    h, n_kv, d = 4, 2, 64
    k = kv_layer("q8_0", 3, 32, n_kv, d, torch.device("cpu"))  # 64 + 2 x 2 bytes a head
    v = kv_layer("f16", 3, 32, n_kv, d, torch.device("cpu"))  # 128 bytes a head
    per_pos = n_kv * (d + 4) + n_kv * 2 * d
    got = attention_prefill(_f32(t, h, d), k, v, 1, start, scale=0.1, window=window)
    assert got == Cost(2 * t * h * d * 4 + keys * per_pos, 4.0 * h * d * pairs)


def test_deltanet_and_norm_costs() -> None:
    hk, hv, dh, kc = 1, 2, 32, 4
    c = (2 * hk + hv) * dh
    conv, ssm = _f32(3, kc - 1, c), _f32(3, hv, dh, dh)
    state, hist = hv * dh * dh * 4, (kc - 1) * c * 4
    dims: dict[str, Any] = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": dh, "eps": 1e-6}
    t = 5
    got = COSTS["deltanet.prefill"](_f32(t, c), _f32(t, hv), _f32(t, hv), conv, ssm, 1,
                                    _f32(c, kc), **dims)  # fmt: skip
    assert got == Cost((t * c + 2 * t * hv + c * kc) * 4 + 2 * (hist + state) + t * hv * dh * 4, 0)
    slots = torch.zeros(2, dtype=torch.int32)
    got = COSTS["deltanet.step"](_f32(2, c), _f32(2, hv), _f32(2, hv), ssm, slots, **dims)
    assert got == Cost((2 * c + 4 * hv) * 4 + 8 + 2 * 2 * state + 2 * hv * dh * 4, 0)
    got = COSTS["deltanet.conv_step"](_f32(2, c), conv, slots, _f32(c, kc))
    assert got == Cost(2 * c * 4 + 8 + c * kc * 4 + 2 * c * 4 + 2 * 2 * hist, 0)
    assert COSTS["norm.rms"](_f32(3, 64), _f32(64), 1e-6) == Cost(3 * 64 * 4 * 2 + 256, 0)


def test_a_call_hands_its_cost_to_the_costed_calls_inside_it() -> None:
    """Decode rows of ``linear.matmul`` run ``linear.matvec``: the matvec carries the figures;
    a method without a cost function passes the hand-off up; a failing cost is no figure."""
    costs = {
        "linear.matmul": lambda n: Cost(1000.0 * n, 1.0),
        "linear.matvec": lambda n: Cost(100.0 * n, 2.0),
        "moe.experts": lambda n: 1 / 0,  # raises: no figure
    }
    tally = Tally(costs)

    def call(label: str, n: int, *inner: tuple[Any, ...]) -> None:
        frame = tally.enter(label, (n,), {})
        for item in inner:
            call(*item)
        tally.leave(frame)

    call("linear.matmul", 3, ("linear.matvec", 3))  # decode rows: the matvec's
    call("linear.matmul", 16)  # a prompt chunk's GEMM: its own
    call("ple.gated", 1, ("linear.matvec", 1))  # no cost function: no row of its own
    call("linear.matmul", 7, ("ple.gated", 7, ("linear.matvec", 7)))  # handed through ple
    call("moe.experts", 1)
    call("moe.experts", 1, ("linear.matvec", 2))  # its cost handed on: no failure counted
    assert tally.figures() == {
        "linear.matmul": Cost(16000.0, 1.0),
        "linear.matvec": Cost(1300.0, 8.0),
    }
    assert tally.rows["moe.experts"] == [0.0, 0.0, 0, 1]  # the failed one, no figures


def test_cells_give_rates_and_the_floor() -> None:
    cost = Cost(3.1e8, 7.75e10)  # in 155 us: 2000 GB/s, 500 TFLOP/s
    assert cells(cost, 155.0, Rates(3100.0, 989.0)) == " 2000 | 500.0 | 0.100 |"
    assert cells(Cost(1e6, 4.945e10), 100.0, Rates(3100.0, 989.0)) == " 10 | 494.5 | 0.050 |"
    assert cells(Cost(1e6, 0.0), 100.0, Rates(None, 989.0)) == " 10 | | |"
    assert cells(None, 100.0, Rates(3100.0)) == " | | |"
    assert nominal_peak("NVIDIA H100 80GB HBM3") == nominal_peak("NVIDIA H200") == 989.0
    assert nominal_peak("NVIDIA GeForce RTX 3090") is None


def _tiny(arch: str, root: Path) -> tuple[Any, Any, Any]:
    """(the torch backend, the tiny ``arch`` model on it, a function running a 5-token prompt
    and one decode step)."""
    from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    ops = torch_backend()
    cpu = torch.device("cpu")
    model = load_device_model(GGUFFile(_export(arch, root)), ops, cpu, 2, 64)
    runner = DeviceRunner(model, cpu, graphs=False)
    greedy = SamplingParams(temperature=0.0)

    def work() -> None:
        for step, (start, tokens) in enumerate(((0, (5, 6, 7, 8, 9)), (5, (10,)))):
            seq = SeqWork(slot=0, request_id="r", tokens=tokens, start=start, sample=True,
                          sampling=greedy, new_sequence=start == 0)  # fmt: skip
            runner.run(ScheduledBatch(step + 1, (seq,)))

    return ops, model, work


@pytest.mark.parametrize("arch", ["qwen3", "qwen3next", "qwen4exp"])
def test_the_cost_functions_take_a_tiny_models_real_calls(arch: str, tmp_path: Path) -> None:
    """A prompt and a decode step of each tiny model on the torch backend under the ranges: no
    cost function fails on the calls the models make, and the costed methods have figures."""
    from mgserve.bench.model.gaps import annotated

    ops, model, work = _tiny(arch, tmp_path)
    tally = Tally()
    with annotated(ops, set(), tally):
        work()
    assert not [lab for lab, r in tally.rows.items() if r[3]]  # no cost function failed
    want = {
        "qwen3": {"linear.matmul", "norm.rms", "attention.prefill"},
        "qwen3next": {
            "linear.matmul",
            "moe.experts",
            "attention.prefill",
            "deltanet.prefill",
            "deltanet.conv_step",
            "deltanet.step",
        },
        "qwen4exp": {"linear.matmul", "moe.experts", "hc.mix", "hc.combine"},  # torch twin:
    }[arch]  # combine_mix hands its cost to combine and mix
    figures = tally.figures()
    assert want <= set(figures), sorted(figures)
    assert all(c.bytes > 0 for c in figures.values())
    if arch == "qwen3":  # 5 prompt queries see 1 + 2 + ... + 5 keys in each layer
        spec = model.spec
        per_layer = 4.0 * spec.n_head * spec.head_dim * 15
        assert figures["attention.prefill"].flops == spec.n_layer * per_layer


def test_gaps_table_hands_the_tallied_costs_and_rates_to_summarize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU run's wiring on the CPU: by family, gaps_table tallies the costs while the work
    runs and gives summarize the figures and the rates; by frame, no costs."""
    from mgserve.bench.model import gaps

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(gaps, "summarize", lambda *a: seen.append(a) or ["table"])
    ops, _, work = _tiny("qwen3", tmp_path)
    rates = Rates(3000.0, 989.0)
    assert gaps.gaps_table(lambda: None, work, "a step", ops, rates) == ["table"]
    ((_, what, _, labels, costs, got_rates),) = seen
    assert what == "a step" and got_rates == rates and "linear.matmul" in labels
    assert {"linear.matmul", "norm.rms", "attention.prefill"} <= set(costs)
    assert all(c.bytes > 0 for c in costs.values())
    assert "matmul" not in vars(ops.linear)  # the methods restored
    gaps.gaps_table(lambda: None, work, "a step", None, rates)
    assert seen[1][3:5] == (None, None)  # by frame: no labels, no costs
