"""The torch MoE family (``MoeTorch``, and the linear family where a test needs both) against the
reference path: gguf-py's dequantization and ``mgserve.core.reference.moe.experts_ffn``, in
float64. Runs on the CPU (CI). The helpers here (random quantized weights and experts, the float64
MoE reference with an error scale) are shared with test_linear_torch.py and the GPU tests
(test_linear.py, test_moe.py, test_moe_prefill.py).

Error scale: a product's rounding error is bounded by a multiple of sum |w_i x_i|, so linear
errors are measured relative to ``|W| @ |x|``, and MoE errors relative to
S = sum_j w_j |down_e| @ |h_j| (exact h; about 20x |out|). A CPU simulation at the target shape
(d 2560, ff 640, Q4_K / Q5_0, 4 tokens x 10 experts) gave max error / S: fp32 ~1e-7; f16
operands (prefill) 2e-4; int8 activations 4e-3; one of ten experts swapped for another 0.13. The
tolerances sit ~5-10x above the first three and well under the last.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mgserve.core.reference.moe import MoeWeights, Routing, experts_ffn
from mgserve.cuda.backend import torch_backend
from mgserve.cuda.ops.moe import ExpertWeights
from mgserve.cuda.weights import FORMATS, QuantWeight, upload_bytes
from tests.cuda.test_linear_matvec import random_tensor, reference_weight

TYPES = sorted(FORMATS)
RTOL_FP32 = 2e-5  # fp32 kernels: linear (vs |W| @ |x|) and MoE (vs S)
RTOL_F16 = 2e-3  # f16 operands, fp32 accumulation (prefill)
RTOL_INT8 = 2e-2  # int8 activations (x and h rounded per 32 values)
POOL_BLOCKS = 4099  # prime: a tiled pool never lines up with rows or experts


def random_bytes(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random bytes of a [rows, k] ``type_name`` tensor, made fast for large tensors: a pool
    of POOL_BLOCKS random blocks tiled (whole blocks, so every block stays valid)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n_blocks = rows * k // block
    if n_blocks <= POOL_BLOCKS:
        return random_tensor(type_name, rows, k, rng)
    pool = random_tensor(type_name, 1, POOL_BLOCKS * block, rng)
    return np.resize(pool, n_blocks * size)


def make_weight(
    type_name: str, rows: int, k: int, rng: np.random.Generator, device: str = "cpu"
) -> tuple[QuantWeight, np.ndarray]:
    raw = random_bytes(type_name, rows, k, rng)
    return upload_bytes(f"w.{type_name}", type_name, (k, rows), raw, device), raw


def bound_error(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """max |y - ref| / scale (all float64 on the CPU)."""
    return ((y.double().cpu() - ref).abs() / scale.clamp_min(1e-30)).max().item()


class ExpertCase(NamedTuple):
    """Random experts: the uploaded ExpertWeights and their raw bytes for the reference."""

    w: ExpertWeights
    raw: dict[str, np.ndarray]  # "gate", "up" or "gate_up", and "down"
    gate_type: str
    down_type: str
    d: int
    cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # dense(e), once each

    def dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate, up [ff, d] and down [d, ff] in float64, through gguf-py."""
        if e not in self.cache:
            self.cache[e] = self._dense(e)
        return self.cache[e]

    def _dense(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ff, d = self.w.n_ff, self.d
        gt, dt = self.gate_type, self.down_type

        total = {"gate": ff, "up": ff, "gate_up": 2 * ff, "down": d}  # rows per expert

        def rows(name: str, type_name: str, r0: int, n: int, k: int) -> torch.Tensor:
            raw = self.raw[name]
            rb = raw.size // (self.w.n_expert * total[name])  # bytes per row
            return reference_weight(type_name, n, k, raw[r0 * rb : (r0 + n) * rb]).double()

        if "gate_up" in self.raw:
            gate = rows("gate_up", gt, 2 * e * ff, ff, d)
            up = rows("gate_up", gt, 2 * e * ff + ff, ff, d)
        else:
            gate, up = rows("gate", gt, e * ff, ff, d), rows("up", gt, e * ff, ff, d)
        return gate, up, rows("down", dt, e * d, d, ff)


def make_case(
    gate_type: str,
    down_type: str,
    n_expert: int,
    d: int,
    ff: int,
    fused: bool,
    seed: int,
    device: str = "cpu",
) -> ExpertCase:
    rng = np.random.default_rng(seed)
    raw: dict[str, np.ndarray] = {}
    names = ["gate_up"] if fused else ["gate", "up"]
    mats: dict[str, QuantWeight] = {}
    for name in names:
        rows = n_expert * ff * (2 if fused else 1)
        raw[name] = random_bytes(gate_type, rows, d, rng)
        shape = (d, rows // n_expert, n_expert)
        mats[name] = upload_bytes(f"ffn_{name}_exps", gate_type, shape, raw[name], device)
    raw["down"] = random_bytes(down_type, n_expert * d, ff, rng)
    down = upload_bytes("ffn_down_exps", down_type, (ff, d, n_expert), raw["down"], device)
    w = ExpertWeights(
        gate=mats.get("gate"),
        up=mats.get("up"),
        gate_up=mats.get("gate_up"),
        down=down,
        n_expert=n_expert,
        n_ff=ff,
    )
    return ExpertCase(w, raw, gate_type, down_type, d, {})


def routing(
    n: int, kk: int, n_expert: int, rng: np.random.Generator, pool: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """experts int32 [n, kk] (distinct per token, drawn from the first ``pool`` experts) and
    positive weights float32 [n, kk] summing to 1 per token."""
    pool = pool or n_expert
    experts = np.stack([rng.permutation(pool)[:kk] for _ in range(n)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, size=(n, kk)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    return torch.from_numpy(experts), torch.from_numpy(weights)


def reference_moe(
    case: ExpertCase, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts_ffn in float64 [N, d], its error scale [N, d]), dequantizing only the experts
    that ``experts`` selects (a 256-expert layer stays cheap)."""
    x64, ex, wt = x.double().cpu(), experts.long().cpu(), weights.double().cpu()
    used = sorted(set(ex.flatten().tolist()))
    dense = {e: case.dense(e) for e in used}
    remap = torch.tensor([used.index(e) for e in ex.flatten().tolist()]).view(ex.shape)
    mw = MoeWeights(
        router=torch.zeros(1, dtype=torch.float64),
        gate=torch.stack([dense[e][0] for e in used]),
        up=torch.stack([dense[e][1] for e in used]),
        down=torch.stack([dense[e][2] for e in used]),
    )
    ref = experts_ffn(x64, mw, Routing(remap, wt))
    scale = torch.zeros_like(ref)
    for n in range(x64.shape[0]):
        for j in range(ex.shape[1]):
            gate, up, down = dense[int(ex[n, j])]
            h = torch.nn.functional.silu(gate @ x64[n]) * (up @ x64[n])  # [ff]
            scale[n] += wt[n, j] * (down.abs() @ h.abs())
    return ref, scale


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gate_type", "down_type", "fused"),
    [("Q4_K", "Q5_0", False), ("Q8_0", "Q6_K", True), ("F16", "Q4_0", False)],
)
def test_moe_torch_matches_reference(gate_type: str, down_type: str, fused: bool) -> None:
    rng = np.random.default_rng(11)
    d, ff = 256, 256
    case = make_case(gate_type, down_type, 6, d, ff, fused, seed=5)
    x = torch.from_numpy(rng.standard_normal((5, d), dtype=np.float32))  # [5, d]
    experts, weights = routing(5, 3, 6, rng)
    experts[:, 0] = 2  # one expert shared by every token
    experts[0, 1] = 0
    y = torch_backend().moe.experts(x, case.w, experts, weights)
    assert y.shape == (5, d) and y.dtype == torch.float32
    ref, scale = reference_moe(case, x, experts, weights)
    err = bound_error(y, ref, scale)
    assert err <= RTOL_FP32, f"{gate_type}/{down_type} fused={fused}: relative error {err:.2e}"


def test_torch_batch_invariant() -> None:
    """On the CPU a token's linear and MoE results are bitwise the same alone or in a batch."""
    rng = np.random.default_rng(4)
    mt = torch_backend()
    w, _ = make_weight("Q4_K", 40, 256, rng)
    case = make_case("Q4_K", "Q8_0", 8, 256, 64, True, seed=4)
    x = torch.from_numpy(rng.standard_normal((7, 256), dtype=np.float32))
    experts, weights = routing(7, 3, 8, rng)
    lin = [mt.linear.matmul(x[:n], w)[0] for n in (1, 4, 7)]
    moe = [mt.moe.experts(x[:n], case.w, experts[:n], weights[:n])[0] for n in (1, 4, 7)]
    for ys in (lin, moe):
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])


def test_shared_expert_in_experts_is_add_shared() -> None:
    """experts(shared=...) (the fused decode path's torch twin) is experts then add_shared,
    bitwise, given add_shared's own gates: gated or not, with a residual or not; ``ready`` runs
    once before the shared output is read."""
    from mgserve.cuda.ops.moe import SharedExpert

    rng = np.random.default_rng(9)
    case = make_case("Q8_0", "Q8_0", 4, 64, 32, False, seed=2)
    x, s, res = (torch.from_numpy(rng.standard_normal((3, 64), dtype=np.float32)) for _ in "xsr")
    gate_inp = torch.from_numpy(rng.standard_normal(64, dtype=np.float32))
    experts, weights = routing(3, 2, 4, rng)
    mt = torch_backend()
    g = mt.moe.add_shared(torch.zeros_like(x), torch.ones_like(x), x, gate_inp)[:, 0]
    routed = mt.moe.experts(x, case.w, experts, weights)
    for gated in (True, False):
        for r in (None, res):
            ready: list[int] = []
            shared = SharedExpert(s, g if gated else None, lambda: ready.append(1))  # noqa: B023
            got = mt.moe.experts(x, case.w, experts, weights, residual=r, shared=shared)
            want = mt.moe.add_shared(routed, s, x, gate_inp if gated else None, r)
            assert torch.equal(got, want) and ready == [1], (gated, r is not None)


def test_moe_torch_int64_ids_and_empty_batch() -> None:
    rng = np.random.default_rng(2)
    case = make_case("Q8_0", "Q8_0", 4, 64, 32, False, seed=1)
    x = torch.from_numpy(rng.standard_normal((3, 64), dtype=np.float32))
    experts, weights = routing(3, 2, 4, rng)
    mt = torch_backend()
    a = mt.moe.experts(x, case.w, experts, weights)
    b = mt.moe.experts(x, case.w, experts.long(), weights)
    assert torch.equal(a, b)
    empty = mt.moe.experts(x[:0], case.w, experts[:0], weights[:0])
    assert empty.shape == (0, 64)


def test_rejects_bad_input() -> None:
    rng = np.random.default_rng(0)
    mt = torch_backend()
    w, _ = make_weight("Q8_0", 4, 64, rng)
    with pytest.raises(ValueError, match=r"expected \[N, 64\]"):
        mt.linear.matmul(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="float32"):
        mt.linear.matmul(torch.zeros(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="outside"):
        mt.linear.dequantize(w, 2, 3, torch.empty(3, 64))
    with pytest.raises(ValueError, match="out has shape"):
        mt.linear.dequantize(w, 0, 2, torch.empty(3, 64))
    with pytest.raises(ValueError, match="float16 or float32"):
        mt.linear.dequantize(w, 0, 2, torch.empty(2, 64, dtype=torch.float64))
    case = make_case("Q8_0", "Q8_0", 4, 64, 32, False, seed=1)
    x = torch.zeros(2, 64)
    experts, weights = routing(2, 2, 4, rng)
    with pytest.raises(ValueError, match=r"expected \[N, 64\]"):
        mt.moe.experts(torch.zeros(2, 32), case.w, experts, weights)
    with pytest.raises(ValueError, match="experts has shape"):
        mt.moe.experts(x, case.w, experts[:1], weights)
    with pytest.raises(ValueError, match="int32"):
        mt.moe.experts(x, case.w, experts.float(), weights)
    with pytest.raises(ValueError, match="weights must be float32"):
        mt.moe.experts(x, case.w, experts, weights.double())
    with pytest.raises(ValueError, match="not both"):
        mt.moe.experts(x, case.w._replace(gate_up=case.w.gate), experts, weights)
    with pytest.raises(ValueError, match="is not 4 experts"):
        mt.moe.experts(x, case.w._replace(n_ff=16), experts, weights)
    mixed = case.w._replace(up=make_case("Q4_0", "Q8_0", 4, 64, 32, False, seed=2).w.up)
    with pytest.raises(ValueError, match="share a format"):
        mt.moe.experts(x, mixed, experts, weights)
