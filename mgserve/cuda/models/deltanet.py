"""Gated DeltaNet layers of the hybrid family (qwen3next, qwen4exp) on the device backend: their
weights, how they load, and the layer's forward (the twin of
``mgserve.core.reference.deltanet.mix`` / ``output``).

qwen4exp files store DeltaNet value heads tiled (value head j reads key head j % H_k). The rows of
the projections that produce value heads (qkv's v part, z, beta, alpha) are reordered at load
into the grouped order the kernels use (j reads j // r); ``ssm_out`` reads value heads along its
input, which block quantization cannot reorder, so the gated norm writes its output heads back
in the file's order instead.

The beta and alpha projections are one weight (rows [beta | alpha]) where their formats allow, and
one ``deltanet.gates`` op turns them into the decay and write strength.

Decode passes the step's runs (``Step.chains``) to the conv and delta-rule steps and, when the
step logs (``Step.log``), logs how to re-run them on some rows from their inputs (qkv, beta and
alpha projections): a verify step's rollback (cuda/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from mgserve.core.gguf.hparams_hybrid import HybridSpec
from mgserve.core.gguf.reader import GGUFError
from mgserve.core.models.hybrid_weights import ssm_in_rows
from mgserve.cuda.loader import Loader, fuse_rows, select_rows
from mgserve.cuda.models.base import Step, fused_matmul
from mgserve.cuda.ops.chains import Chains
from mgserve.cuda.pools import SlotPools
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend
    from mgserve.cuda.ops.branch import Fork

DELTA_CHUNK = 128  # tokens per step of the chunked delta rule in prefill (same results as 64)


@dataclass
class DeltaNet:
    qkv: QuantWeight  # [conv_dim, d] rows [q | k | v (grouped value heads)]
    z: QuantWeight  # [value_dim, d] (grouped)
    ba: list[QuantWeight]  # [2 H_v, d] rows [beta | alpha] (grouped), or [beta, alpha] (fuse_rows)
    conv: torch.Tensor  # [conv_dim, K]
    dt_bias: torch.Tensor  # [H_v]
    a: torch.Tensor  # [H_v]
    norm: torch.Tensor  # [d_v]
    out: QuantWeight  # [d, value_dim] in the file's value-head order
    out_heads: torch.Tensor | None  # [H_v] int32: where grouped head j sits in ``out``'s input
    sigmoid_gate: bool


def _grouped_from_tiled(hp: HybridSpec) -> torch.Tensor:
    """[H_v] int64: for each grouped value head j (reads key head j // r), its index in the tiled
    order qwen4exp files use (reads key head t % H_k)."""
    hk, r = hp.ssm_k_heads, hp.ssm_v_heads // hp.ssm_k_heads
    j = torch.arange(hp.ssm_v_heads)
    return (j % r) * hk + j // r


def _head_rows(heads: torch.Tensor, width: int) -> torch.Tensor:
    """Row indices of whole heads of ``width`` rows each, in the order ``heads`` lists them."""
    return (heads[:, None] * width + torch.arange(width)).flatten()


def load_deltanet(ld: Loader, il: int, d: int, hp: HybridSpec, arch: str) -> DeltaNet:
    """Layer ``il``'s DeltaNet weights (``attn_qkv`` / ``attn_gate``, or qwen3next's legacy fused
    ``ssm_in``), value heads in grouped order."""
    hv, hk, dv, kd = hp.ssm_v_heads, hp.ssm_k_heads, hp.ssm_head_dim, hp.key_dim
    r, p = hv // hk, f"blk.{il}."
    if ld.has(p + "attn_qkv.weight"):
        qkv = ld.mat(p + "attn_qkv.weight", (d, hp.conv_dim))
        z = ld.mat(p + "attn_gate.weight", (d, hp.value_dim))
    elif ld.has(p + "ssm_in.weight") and arch == "qwen3next":  # legacy fused [q|k|v|z]
        fused = ld.mat(p + "ssm_in.weight", (d, hp.conv_dim + hp.value_dim))
        qkv_rows, z_rows = ssm_in_rows(hp)
        qkv, z = select_rows(fused, qkv_rows), select_rows(fused, z_rows)
    else:
        raise GGUFError(f"{ld.g.path}: layer {il} has neither 'attn_qkv' nor 'ssm_in'")
    conv = ld.vec(p + "ssm_conv1d.weight", (hp.ssm_conv, hp.conv_dim))  # [conv_dim, K]
    dt_bias = ld.vec(p + "ssm_dt.bias", (hv,))
    a = ld.vec(p + "ssm_a", (hv,))
    out = ld.mat(p + "ssm_out.weight", (hp.value_dim, d))
    if arch == "qwen4exp":
        heads = _grouped_from_tiled(hp)  # grouped head j <- tiled head heads[j]
        v_rows = 2 * kd + _head_rows(heads, dv)
        qkv = select_rows(qkv, torch.cat((torch.arange(2 * kd), v_rows)))
        z = select_rows(z, _head_rows(heads, dv))
        v_taps = conv[2 * kd :].view(hv, dv, -1)[heads.to(conv.device)]  # [H_v, d_v, K]
        conv = torch.cat((conv[: 2 * kd], v_taps.reshape(-1, conv.shape[1])))
        dt_bias, a = dt_bias[heads.to(dt_bias.device)], a[heads.to(a.device)]
        ba = fuse_rows(
            select_rows(ld.mat(p + "ssm_beta.weight", (d, hv)), heads),
            select_rows(ld.mat(p + "ssm_alpha.weight", (d, hv)), heads),
        )
        out_heads = heads.to(device=ld.device, dtype=torch.int32)
    else:
        fused = ld.mat(p + "ssm_ba.weight", (d, 2 * hv))  # per key head: [beta (r) | alpha (r)]
        j = torch.arange(hv)
        beta_rows = (j // r) * 2 * r + j % r
        ba, out_heads = [select_rows(fused, torch.cat((beta_rows, beta_rows + r)))], None
    return DeltaNet(
        qkv=qkv, z=z, ba=ba, conv=conv.contiguous(), dt_bias=dt_bias, a=a,
        norm=ld.vec(p + "ssm_norm.weight", (dv,)), out=out, out_heads=out_heads,
        sigmoid_gate=arch == "qwen4exp",
    )  # fmt: skip


def deltanet_forward(
    b: Backend, pools: SlotPools, il: int, w: DeltaNet, h: torch.Tensor, step: Step,
    hp: HybridSpec, eps: float, residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """residual + the layer's output [N, d] for the normed input h [N, d]; the slots' conv and
    recurrent states advance (decode: one kernel step for all sessions; prefill: span by span)."""
    hk, hv, dh = hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim
    xq = b.linear.quantize(h)
    side = b.branch.fork()  # decode: z and beta/alpha beside qkv and the conv
    with side:
        z = b.linear.matmul(h, w.z, xq=xq)  # [N, value_dim]
        beta_x, alpha_x = fused_matmul(b, h, w.ba, [hv, hv], xq)  # [N, H_v] each
    qkv = b.linear.matmul(h, w.qkv, xq=xq)  # [N, conv_dim]
    conv, ssm = pools.conv[il], pools.ssm[il]
    if step.decode:
        o = _decode(b, w, conv, ssm, qkv, beta_x, alpha_x, step.slots, step.chains, hp, eps, side)
        if step.log is not None:
            step.log.append(partial(_replay, b, w, conv, ssm, qkv, beta_x, alpha_x, hp, eps))
    else:
        side.join()
        g, beta = b.deltanet.gates(beta_x, alpha_x, w.dt_bias, w.a)
        parts, off = [], 0
        for s in step.spans:
            sl = slice(off, off + s.n)
            parts.append(
                b.deltanet.prefill(
                    qkv[sl], g[sl], beta[sl], conv, ssm, s.slot, w.conv, n_k_heads=hk,
                    n_v_heads=hv, head_dim=dh, eps=eps, chunk=DELTA_CHUNK,
                )
            )  # fmt: skip
            off += s.n
        o = torch.cat(parts)
    fuse = b.linear.fused_xq(z.shape[0], z.shape[1])  # the norm writes ssm_out's int8 input
    out, oq = b.norm.gated_xq(o, z, w.norm, eps, w.sigmoid_gate, w.out_heads, xq=fuse)
    return b.linear.matmul(out, w.out, residual=residual, xq=oq)


def _decode(
    b: Backend, w: DeltaNet, conv: torch.Tensor, ssm: torch.Tensor, qkv: torch.Tensor,
    beta_x: torch.Tensor, alpha_x: torch.Tensor, slots: torch.Tensor, chains: Chains | None,
    hp: HybridSpec, eps: float, side: Fork | None = None,
) -> torch.Tensor:  # fmt: skip
    """The decode rows' conv and delta-rule steps: o [N, H_v, d_v] (``side``: the fork that
    computes beta_x and alpha_x, joined before the gates read them)."""
    y = b.deltanet.conv_step(qkv, conv, slots, w.conv, chains)
    if side is not None:
        side.join()
    return b.deltanet.step_gates(
        y, beta_x, alpha_x, w.dt_bias, w.a, ssm, slots, n_k_heads=hp.ssm_k_heads,
        n_v_heads=hp.ssm_v_heads, head_dim=hp.ssm_head_dim, eps=eps, chains=chains,
    )  # fmt: skip


def _replay(
    b: Backend, w: DeltaNet, conv: torch.Tensor, ssm: torch.Tensor, qkv: torch.Tensor,
    beta_x: torch.Tensor, alpha_x: torch.Tensor, hp: HybridSpec, eps: float,
    rows: torch.Tensor, slots: torch.Tensor, chains: Chains,
) -> None:  # fmt: skip
    """``_decode`` again on the logged inputs of ``rows`` (a ``Replay``)."""
    qkv, beta_x, alpha_x = (t.index_select(0, rows) for t in (qkv, beta_x, alpha_x))
    _decode(b, w, conv, ssm, qkv, beta_x, alpha_x, slots, chains, hp, eps)
