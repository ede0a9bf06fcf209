"""The CUDA matvec against the reference: random valid blocks of every supported type, dequantized
by ``mgserve.core.reference.dequant.dequantize`` (gguf-py) and multiplied in float64 on the CPU.

Tolerance: each output is a sum of k fp32 products accumulated in fp32 (8 products per lane-step,
k/256 steps per lane, then a 32-lane tree), so its error is bounded by a small multiple of
k * 2^-24 * sum_i |w_i x_i| and is typically ~sqrt(k) * 2^-24 of it. We allow
|y - ref| <= 2e-5 * (|W| @ |x|), which is 4x the worst-case bound at k = 2560 and catches any
wrong nibble, scale or offset (those move outputs by ~1e-2 of that sum or more).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mgserve.core.gguf.reader import TensorInfo
from mgserve.core.reference.dequant import dequantize
from mgserve.core.synth.blocks import make_pool, supported
from mgserve.cuda.weights import FORMATS, QuantWeight, upload_bytes

pytestmark = pytest.mark.gpu

RTOL = 2e-5
TYPES = sorted(FORMATS)
# (rows, blocks per row, tokens): one row of one block; odd rows and tokens; a 2560-wide layer
CASES = [(1, 1, 1), (7, 3, 3), (33, None, 8), (130, None, 1), (5, None, 2)]
WIDE = 2560


def random_tensor(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random bytes of a [rows, k] tensor of ``type_name`` (finite fp16 scales)."""
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    n_bytes = rows * k // block * size
    if supported(qtype):
        return make_pool(qtype, rng, n_bytes)[:n_bytes]
    # the IQ types and MXFP4: random bytes, then each block's scale made finite and moderate
    blocks = rng.integers(0, 256, size=(n_bytes // size, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-3, size=len(blocks)).astype("<f2")
    if type_name == "MXFP4":  # u8 E8M0 exponent at 0: scales 2^-13 .. 2^0
        blocks[:, 0] = rng.integers(115, 129, size=len(blocks), dtype=np.uint8)
    elif type_name == "IQ1_M":  # d's four nibbles are the top nibbles of the u16s at 48..55
        bits = d.view("<u2").astype(np.uint16)
        words = blocks[:, 48:56].copy().view("<u2")  # [n_blocks, 4]
        for i in range(4):
            nibble = (bits >> np.uint16(4 * i)) & np.uint16(0xF)
            words[:, i] = (words[:, i] & np.uint16(0x0FFF)) | (nibble << np.uint16(12))
        blocks[:, 48:56] = words.view(np.uint8)
    else:  # IQ4_NL, IQ4_XS, IQ2_*, IQ3_*, IQ1_S: fp16 d at offset 0
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference_weight(type_name: str, rows: int, k: int, raw: np.ndarray) -> torch.Tensor:
    """float32 [rows, k] through the reference path's dequantize (the oracle)."""
    qtype = GGMLQuantizationType[type_name]
    data = {"F32": np.float32, "F16": np.float16}.get(type_name)
    t = TensorInfo(
        name="w",
        type_name=type_name,
        type_id=int(qtype),
        shape=(k, rows),
        n_elements=rows * k,
        n_bytes=raw.size,
        offset=0,
        data=raw.view(data) if data is not None else raw,
    )
    return dequantize(None, t)  # type: ignore[arg-type]  # the file is only named in errors


def check(ops, stream, type_name: str, rows: int, k: int, n_tok: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    raw = random_tensor(type_name, rows, k, rng)
    w = upload_bytes(f"w.{type_name}", type_name, (k, rows), raw)
    x = torch.from_numpy(rng.standard_normal((n_tok, k), dtype=np.float32))  # [n_tok, k]
    out = torch.full((n_tok, rows), float("nan"), device="cuda")  # poisoned: all must be written
    torch.cuda.synchronize()
    ops.matvec(w, x.cuda(), stream, out=out)
    stream.sync()
    y = out.cpu().double()
    wref = reference_weight(type_name, rows, k, raw).double()  # [rows, k]
    ref = x.double() @ wref.T  # [n_tok, rows]
    bound = x.double().abs() @ wref.abs().T
    assert torch.isfinite(y).all(), f"{type_name}: unwritten or non-finite outputs"
    err = ((y - ref).abs() / bound.clamp_min(1e-30)).max().item()
    assert err <= RTOL, f"{type_name} rows={rows} k={k} n_tok={n_tok}: relative error {err:.2e}"
    return err


@pytest.mark.parametrize("type_name", TYPES)
def test_matvec_matches_reference(ops, stream, type_name: str) -> None:
    block = FORMATS[type_name].block
    block = 32 if block == 8 else block  # plain types: "one block" = 32 values, still 4 runs
    errors = []
    for i, (rows, n_blocks, n_tok) in enumerate(CASES):
        k = WIDE if n_blocks is None else n_blocks * block
        seed = 1000 * i + TYPES.index(type_name)
        errors.append(check(ops, stream, type_name, rows, k, n_tok, seed))
    print(f"matvec {type_name}: max relative error {max(errors):.2e} over {len(CASES)} shapes")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "F16"])
def test_matvec_layer_shape(ops, stream, type_name: str) -> None:
    """A full-width layer (qwen4exp's 9728 x 2560 up projection has k = 2560; this is its down)."""
    k = 9728  # 38 Q4_K blocks
    err = check(ops, stream, type_name, rows=2560, k=k, n_tok=4, seed=7)
    print(f"matvec {type_name} 2560x{k}: max relative error {err:.2e}")


def test_matvec_rejects_bad_input(ops, stream) -> None:
    rng = np.random.default_rng(0)
    raw = random_tensor("Q4_K", 4, 512, rng)
    w = upload_bytes("blk.0.ffn_up.weight", "Q4_K", (512, 4), raw)
    good = torch.zeros(512, device="cuda")
    with pytest.raises(ValueError, match=r"expected \[512\]"):
        ops.matvec(w, torch.zeros(256, device="cuda"), stream)
    with pytest.raises(ValueError, match="1..8 tokens"):
        ops.matvec(w, torch.zeros(9, 512, device="cuda"), stream)
    with pytest.raises(ValueError, match="float32"):
        ops.matvec(w, good.double(), stream)
    with pytest.raises(ValueError, match="contiguous"):
        ops.matvec(w, torch.zeros(512, 2, device="cuda")[:, 0], stream)
    with pytest.raises(ValueError, match="cuda"):
        ops.matvec(w, good.cpu(), stream)
    with pytest.raises(ValueError, match="out has shape"):
        ops.matvec(w, good, stream, out=torch.zeros(5, device="cuda"))
    bad = QuantWeight("t", "Q4_K", (512, 4), w.data[:, :100])
    with pytest.raises(ValueError, match="contiguous"):
        ops.matvec(bad, good, stream)


def linear_cuda(kernels, **kw):
    """A LinearCuda of its own (tunings, q8 shapes) on the session's kernels."""
    from mgserve.cuda.dequantized import DenseWeights
    from mgserve.cuda.ops.linear import LinearTorch
    from mgserve.cuda.ops.linear_cuda import LinearCuda

    return LinearCuda(kernels, LinearTorch(DenseWeights()), **kw)


# every tuning the bench compares must compute the same function (rows per warp clamps the last
# warp's extra rows; the unroll has a remainder loop)
TUNINGS = ["1,1,1", "1,2,4", "2,4,8", "1,3,4"]  # R NT = 6..24: one warp_sum a value


@pytest.mark.parametrize("tuning", TUNINGS)
def test_matvec_tunings_match_reference(kernels, stream, tuning: str) -> None:
    from mgserve.cuda.ops.linear_tuning import MatvecTuning

    ops = linear_cuda(kernels, tuning=MatvecTuning.parse(tuning))
    for i, type_name in enumerate(TYPES):
        block = max(32, FORMATS[type_name].block)
        for rows, k, n_tok in [
            (13, 5 * block, 1),
            (13, 5 * block, 8),
            (3, block, 5),
            (70, 2560, 2),
        ]:
            check(ops, stream, type_name, rows, k, n_tok, seed=17 * i + rows)


def test_tuning_is_validated() -> None:
    from mgserve.cuda.ops.linear_tuning import MatvecTuning

    with pytest.raises(ValueError, match="three integers"):
        MatvecTuning.parse("1,2")
    with pytest.raises(ValueError, match="unroll must be in 1..16"):
        MatvecTuning(1, 1, 0)
    with pytest.raises(ValueError, match="unroll must be in 1..16"):
        MatvecTuning(1, 1, 17)
    with pytest.raises(ValueError, match="rows_per_warp_n must be in 1..8"):
        MatvecTuning(1, 9, 4)
