"""A needle at 250,000 tokens: QSA (qwen4exp's indexed sparse attention) picks one planted block
out of 62,500 for the last query, attends to it, and the CUDA family agrees with the torch one.

Op level (gpu), at the real model's shapes (``QWEN4EXP_FLASH_NEXT``: 24 query heads, 2 KV heads of
256, indexer 4 x 128, blocks of 4 tokens, a budget of 2048 tokens = 512 blocks): slot 1 holds
positions 0..250,000 of random q8_0 K/V and block keys (``cuda/fill.py``'s synthetic fill), the
query sits at 250,000 (62,500 complete blocks, a 1-cell tail); slot 0 is a second session at
131,072 in the same batch. The needle is block 9250 (positions 37,000..37,003): its block key is
4 * sign(sum of the query's indexer heads), its K cells lie along the query heads of each KV group
(attention logit ~16 against ~N(0, 1) for random cells), its V cells are a +-2 sign pattern. Block
keys and indexer queries are rounded to multiples of 1/8, so every block score is an exact fp32 sum
in both versions and the top-512 cut cannot hinge on rounding. Checked:

(a) the selection (the decode path's own kernels, ``score_and_select``; ``select_blocks`` of both
    families on the same scores) holds the needle, whose score is the row's highest; the two
    families select the same blocks;
(b) ``QsaCuda.decode`` equals ``QsaTorch.decode`` on the same pools (``close``: 2e-5 of each row's
    max, as tests/cuda/test_qsa.py), and the needle row alone equals it beside slot 0, bitwise;
(c) every head's output is >= 90% the needle's V (its projection on it), and ~0% in a control
    run where the needle's block key scores 0 (so the block is not selected).

Model level: the tiny qwen4exp of test_device_models.py (2 QSA layers of 8, indexer 2 x 32,
budget 64 = 16 blocks) with pools of 262,144 positions filled to 250,000 by ``fill_synthetic``,
decoding the token at 250,000. The needle is planted layer by layer from the model's OWN indexer
and attention queries of that step (captured from the torch family's ``qsa.decode``; later layers
are captured after the earlier ones hold their needle): its block key along the indexer heads' sum
scaled to 8x the best random block's score, its K cells along each KV group's mean query, its V
cells a sign pattern. The random blocks outside that query's best 15 get their keys halved (relu
is positively homogeneous: their scores halve), so the 16 selected blocks are far from the cut and
the two backends' slightly different indexer queries cannot select differently. Then the CUDA
backend and the torch backend decode the same state: each QSA layer's selection holds the needle
(and the two select the same blocks), each head's output is mostly the needle's V, and the logits
agree within test_device_models.py's tolerance. On the CPU (CI) the torch backend alone runs the
same planting and the checks (a) and (c).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.synth.shapes import QWEN4EXP_FLASH_NEXT as SHAPE
from mgserve.cuda.fill import fill_synthetic
from mgserve.cuda.models.base import Span, Step
from mgserve.cuda.ops import qsa as qsa_ops
from mgserve.cuda.pools import KVLayer, SlotPools
from tests.cuda.attention_inputs import close
from tests.cuda.test_device_models import TOL_CUDA, _export

RATIO, BUDGET = SHAPE.compress_ratio, SHAPE.indexer_top_k
TOP = BUDGET // RATIO
DEPTH = 250_000  # the query's position: 250,000 positions before it
N_CTX = 262_144  # the real model's context per slot
NEEDLE = 37_000 // RATIO  # block 9250: positions 37,000..37,003
OTHER = 131_072  # the second session's query position (op level)
NEEDLE_LOGIT = 16.0  # attention logit of the needle's cells
MIN_WEIGHT = 0.9  # the least share of the needle's V in any head's output when it is selected


def _i32(xs: list[int], dev: Any) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=dev)


def _write_cells(ops: Any, kv: KVLayer, slot: int, rows: torch.Tensor) -> None:
    """rows [n_kv, D] into every cell of the needle's block of ``slot`` (q8_0, the family's
    own rounding)."""
    pos = torch.arange(NEEDLE * RATIO, NEEDLE * RATIO + RATIO, device=rows.device)
    x = rows[None].expand(RATIO, -1, -1).contiguous()
    ops.kv.write(kv, x, torch.full_like(pos, slot).int(), pos.int())


def _needle_weights(out: torch.Tensor, v: torch.Tensor, n_head: int) -> torch.Tensor:
    """[H] share of each head's output [H * D] along its KV group's needle V [n_kv, D]."""
    n_kv, d = v.shape
    heads = out.view(n_head, d)
    vg = v.repeat_interleave(n_head // n_kv, dim=0)  # [H, D]
    return (heads * vg).sum(-1) / (vg * vg).sum(-1)


def _op_state(dev: Any) -> SimpleNamespace:
    """Pools, queries and the needle of the op-level test (see the module docstring)."""
    n_head, n_kv, d = SHAPE.n_head, SHAPE.n_head_kv, SHAPE.head_dim
    pools = SlotPools(2, N_CTX)
    pools.add_attention(0, "q8_0", "q8_0", n_kv, d, dev)
    pools.add_qsa(0, RATIO, SHAPE.indexer_dim, dev)
    state = SimpleNamespace(pools=pools)
    fill_synthetic(state, 1, DEPTH + 1)  # only .pools is read
    fill_synthetic(state, 0, OTHER + 1)
    pools.blocks[0].mul_(8).round_().div_(8)  # exact fp32 scores
    g = torch.Generator(device=dev).manual_seed(1)
    sign = torch.randint(0, 2, (2, n_kv, d), generator=g, device=dev).float() * 2 - 1
    k_dir, v = sign[0], 2 * sign[1]  # [n_kv, D] each
    scale = 1 / math.sqrt(d)
    q = torch.randn(2, n_head, d, generator=g, device=dev)
    q[0] += NEEDLE_LOGIT / (scale * d) * k_dir.repeat_interleave(n_head // n_kv, dim=0)
    iq = torch.randn(2, SHAPE.indexer_heads, SHAPE.indexer_dim, generator=g, device=dev)
    iq = iq.mul_(8).round_().div_(8)
    return SimpleNamespace(
        pools=pools, q=q, iq=iq, k_dir=k_dir, v=v, scale=scale, key=4 * iq[0].sum(0).sign(),
        slots=_i32([1, 0], dev), lengths=_i32([DEPTH + 1, OTHER + 1], dev),
    )  # fmt: skip


@pytest.mark.gpu
def test_qsa_finds_and_attends_a_needle_at_250k(cuda_ops, torch_ops) -> None:
    dev = torch.device("cuda")
    s = _op_state(dev)
    k, v, blocks = s.pools.k[0], s.pools.v[0], s.pools.blocks[0]
    _write_cells(torch_ops, k, 1, s.k_dir)
    _write_cells(torch_ops, v, 1, s.v)
    v_needle = qsa_ops.dequant(v, 1, NEEDLE * RATIO)  # [n_kv, D] as stored
    n_blk = blocks.shape[1]
    kw = {"ratio": RATIO, "budget": BUDGET, "scale": s.scale}

    def decode(ops: Any, n: int = 2) -> torch.Tensor:
        return ops.qsa.decode(s.q[:n], s.iq[:n], k, v, blocks, s.slots[:n], s.lengths[:n], **kw)

    def selection() -> torch.Tensor:
        return cuda_ops.qsa.score_and_select(s.iq, blocks, s.slots, s.lengths, n_blk, RATIO, TOP)

    blocks[1, NEEDLE] = 0.0  # control: the needle's block scores exactly 0 and is not selected
    assert NEEDLE not in selection()[0].tolist(), "control: a 0-score block was selected"
    ctrl = _needle_weights(decode(cuda_ops)[0], v_needle, SHAPE.n_head)
    print(f"control: needle share per head {ctrl.min():.3f}..{ctrl.max():.3f}")
    assert ctrl.abs().max() < 0.05, f"control: the unselected needle shows in the output: {ctrl}"

    blocks[1, NEEDLE] = s.key
    sel = selection()
    assert NEEDLE in sel[0].tolist(), f"needle block {NEEDLE} not selected: {sel[0].tolist()}"
    want = qsa_ops.mask_incomplete(
        torch.cat([qsa_ops.block_scores(s.iq[i : i + 1], blocks[int(sl)]) for i, sl in
                   enumerate(s.slots.tolist())]), s.lengths.long(), RATIO,
    )  # fmt: skip
    got = cuda_ops.qsa.scores(s.iq, blocks, s.slots, s.lengths, n_blk, RATIO, TOP)[:, :n_blk]
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), "block scores: -inf pattern differs"
    err = ((got[fin] - want[fin]).abs().max() / want[fin].abs().max()).item()
    assert err <= 1e-6, f"block scores: relative error {err:.2e} (exact sums, one division)"
    top2 = want[0].topk(2)
    print(f"needle score {want[0, NEEDLE]:.2f}, best other {top2.values[1]:.2f}; error {err:.1e}")
    assert int(top2.indices[0]) == NEEDLE, f"the needle is not the best block: {top2}"
    for name, ops in (("cuda", cuda_ops), ("torch", torch_ops)):
        other = ops.qsa.select_blocks(want, s.lengths, ratio=RATIO, top=TOP)
        assert torch.equal(other, sel), f"{name} select_blocks differs from the decode selection"

    out = decode(cuda_ops)
    close("qsa decode with a needle at 250k", out, decode(torch_ops))
    assert torch.equal(decode(cuda_ops, 1)[0], out[0]), "the needle row depends on its batch"
    w = _needle_weights(out[0], v_needle, SHAPE.n_head)
    print(f"needle share per head {w.min():.4f}..{w.max():.4f}")
    assert w.min() >= MIN_WEIGHT, f"needle share per head below {MIN_WEIGHT}: {w.tolist()}"


# ---- the model's own indexer: tiny qwen4exp ---------------------------------------------------


class _Decode:
    """One decode step of the token at DEPTH in slot 0 of ``model``, repeatable: the recurrent and
    pending state the step advances is put back before each run (K/V at DEPTH is rewritten by the
    step itself, and DEPTH % ratio == 0 completes no block). Each QSA layer's ``qsa.decode`` call
    is captured: its query, indexer query and output."""

    def __init__(self, model: Any, token: int) -> None:
        p = model.pools
        live = [*p.conv.values(), *p.ssm.values(), *p.pending.values()]
        live += [] if p.ple_conv is None else [p.ple_conv]
        self.model, self.saved = model, [(t, t.clone()) for t in live]
        self.layer_of = {b.data_ptr(): il for il, b in p.blocks.items()}
        dev = model.device
        extra = model.step_extra([[token]], [0])  # once: it advances the slot's PLE history
        self.step = Step(
            torch.tensor([token], device=dev), _i32([DEPTH], dev), _i32([0], dev), decode=True,
            spans=(Span(0, DEPTH, 1),), extra=None if extra is None else extra.to(dev),
        )  # fmt: skip

    def restore(self) -> None:
        for t, saved in self.saved:
            t.copy_(saved)

    def __call__(self) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
        self.restore()
        qsa, calls = self.model.backend.qsa, {}
        decode = qsa.decode

        def capture(q: Any, iq: Any, k: Any, v: Any, blocks: Any, *a: Any, **kw: Any) -> Any:
            out = decode(q, iq, k, v, blocks, *a, **kw)
            calls[self.layer_of[blocks.data_ptr()]] = (q.clone(), iq.clone(), out.clone())
            return out

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(qsa, "decode", capture)
            logits = self.model.forward(self.step).float()
        return logits, calls


def _plant(model: Any, run: _Decode) -> dict[int, torch.Tensor]:
    """The needle in every QSA layer of slot 0, from the step's own queries, layer by layer (a
    layer's queries depend on the earlier layers' needles); returns each layer's needle V
    [n_kv, D] as stored. Leaves the state as before the step."""
    spec, pools, ops = model.spec, model.pools, model.backend
    g = torch.Generator(device=model.device).manual_seed(2)
    n_kv, d = spec.n_head_kv, spec.head_dim
    v_stored = {}
    top = model.qp.idx_budget // RATIO
    for il in sorted(pools.blocks):
        q, iq, _ = run()[1][il]
        keys = pools.blocks[il][0, : (DEPTH + 1) // RATIO]  # [n_blk, D_idx] the complete blocks
        scores = qsa_ops.block_scores(iq[:1], keys)[0]
        rest = torch.ones_like(scores, dtype=torch.bool)
        rest[scores.topk(top - 1).indices] = False
        keys[rest] = keys[rest] * 0.5  # their scores halve: a clear cut below the best top - 1
        u = iq[0].sum(0) / iq[0].sum(0).norm()
        keys[NEEDLE] = u * (8 * scores.max() / qsa_ops.block_scores(iq[:1], u[None])[0, 0])
        m = q[0].view(n_kv, -1, d).mean(1)  # [n_kv, D] each KV group's mean query
        norm = m.norm(dim=-1, keepdim=True)
        _write_cells(ops, pools.k[il], 0, m / norm * NEEDLE_LOGIT / (spec.attn_scale * norm))
        v = torch.randint(0, 2, (n_kv, d), generator=g, device=model.device).float() * 2 - 1
        _write_cells(ops, pools.v[il], 0, v)
        v_stored[il] = qsa_ops.dequant(pools.v[il], 0, NEEDLE * RATIO)
    run.restore()
    return v_stored


def _check_needle(ops: Any, model: Any, calls: dict, v_needle: dict, name: str) -> dict:
    """(a) and (c) of the module docstring for each QSA layer of one run: the selections of
    ``ops``' family (CUDA: the decode path's own scoring and selection kernels), by layer."""
    lengths = _i32([DEPTH + 1], model.device)
    top, sels = model.qp.idx_budget // RATIO, {}
    for il, (_, iq, out) in calls.items():
        blocks = model.pools.blocks[il]
        if hasattr(ops.qsa, "score_and_select"):
            n_blk = blocks.shape[1]
            sel = ops.qsa.score_and_select(iq, blocks, _i32([0], model.device), lengths, n_blk,
                                           RATIO, top)  # fmt: skip
        else:
            scores = qsa_ops.mask_incomplete(qsa_ops.block_scores(iq, blocks[0]), lengths, RATIO)
            sel = ops.qsa.select_blocks(scores, lengths, ratio=RATIO, top=top)
        sels[il] = sel[0].tolist()
        assert NEEDLE in sels[il], f"{name} layer {il}: block {NEEDLE} not selected: {sels[il]}"
        w = _needle_weights(out[0], v_needle[il], model.spec.n_head)
        print(f"{name} layer {il}: needle share per head {[round(x, 4) for x in w.tolist()]}")
        assert w.min() >= MIN_WEIGHT, f"{name} layer {il}: needle share {w.tolist()}"
    return sels


def _load(path: Path, ops: Any, dev: torch.device) -> Any:
    from mgserve.cuda.backend import load_device_model

    model = load_device_model(GGUFFile(path), ops, dev, 1, N_CTX, "q8_0", "q8_0")
    model.begin_sequence(0)
    fill_synthetic(model, 0, DEPTH)
    return model


def _copy_state(src: SlotPools, dst: SlotPools) -> None:
    for name in ("k", "v"):
        for il, kv in getattr(src, name).items():
            getattr(dst, name)[il].values.copy_(kv.values)
            getattr(dst, name)[il].scales.copy_(kv.scales)
    for name in ("conv", "ssm", "blocks", "pending"):
        for il, t in getattr(src, name).items():
            getattr(dst, name)[il].copy_(t)
    if src.ple_conv is not None and dst.ple_conv is not None:
        dst.ple_conv.copy_(src.ple_conv)


def test_tiny_qwen4exp_selects_and_attends_its_needle_on_the_cpu(tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    model = _load(_export("qwen4exp", tmp_path), torch_backend(), torch.device("cpu"))
    run = _Decode(model, token=123)
    v_needle = _plant(model, run)
    logits, calls = run()
    assert set(calls) == set(model.pools.blocks) and torch.isfinite(logits).all()
    _check_needle(model.backend, model, calls, v_needle, "torch (cpu)")


@pytest.mark.gpu
def test_tiny_qwen4exp_needle_at_250k_cuda_equals_torch(cuda_ops, torch_ops, tmp_path) -> None:
    dev = torch.device("cuda", 0)
    path = _export("qwen4exp", tmp_path)
    ref, cud = _load(path, torch_ops, dev), _load(path, cuda_ops, dev)
    run_ref = _Decode(ref, token=123)
    v_needle = _plant(ref, run_ref)
    _copy_state(ref.pools, cud.pools)  # the same state, needles included
    run_cud = _Decode(cud, token=123)
    want, calls_ref = run_ref()
    got, calls_cud = run_cud()
    sel_ref = _check_needle(torch_ops, ref, calls_ref, v_needle, "torch")
    sel_cud = _check_needle(cuda_ops, cud, calls_cud, v_needle, "cuda")
    assert sel_cud == sel_ref, f"the families select different blocks: {sel_cud} vs {sel_ref}"
    err = float((got - want).abs().max() / want.abs().max())
    print(f"logits: relative error {err:.2e}")
    assert err < TOL_CUDA, f"logits at 250k: relative error {err:.2e} (tolerance {TOL_CUDA:.0e})"
