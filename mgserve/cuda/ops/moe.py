"""The MoE family: one layer's routed experts applied to the tokens routed to them,
sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x) with e = experts[:, j] (the routing itself
is the route family's), plus a residual; and the sigmoid-gated shared expert's sum into it
(``add_shared``).

``MoeTorch`` runs every expert on every token and gathers each token's choices: static shapes and
no host sync (a decode step captures into a CUDA graph), N * E * d work, meant for tiny test
models. ``MoeCuda`` (moe_cuda.py) reads only the chosen experts' rows in decode and runs the
grouped tensor-core products of moe_prefill_cuda.py for prompt chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from mgserve.core.reference import ops, rowwise
from mgserve.cuda.checks import check_f32, shape_error
from mgserve.cuda.dequantized import DenseWeights
from mgserve.cuda.ops.linear import rows_linear
from mgserve.cuda.ops.linear_tuning import Q8Activations
from mgserve.cuda.weights import QuantWeight

MOE_MAX_KK = 64  # MOE_MAX_KK in moe.cu / moe_q8.cu: experts per token


class SharedExpert(NamedTuple):
    """The shared expert's part of a decode step's MoE sum, added by the down kernel."""

    out: torch.Tensor  # [N, d] float32: the shared expert's output
    gate: torch.Tensor | None  # [N] float32: sigmoid(h . gate_inp) (route.router), or ungated
    ready: Callable[[], None]  # makes ``out`` ready on the current stream (the branch's join)


class ExpertWeights(NamedTuple):
    """One layer's routed experts as GGUF stores them (3-D tensors, expert index outermost).

    Either ``gate`` and ``up`` (ffn_gate_exps / ffn_up_exps, GGUF shape (d, ff, E): rows E * ff,
    expert e = rows [e ff, (e + 1) ff)) or ``gate_up`` (ffn_gate_up_exps, (d, 2 ff, E): expert e =
    gate rows [2e ff, 2e ff + ff), then its ff up rows). ``down`` is ffn_down_exps, (ff, d, E):
    rows E * d, expert e = rows [e d, (e + 1) d).
    """

    gate: QuantWeight | None
    up: QuantWeight | None
    gate_up: QuantWeight | None
    down: QuantWeight
    n_expert: int
    n_ff: int

    @property
    def n_embd(self) -> int:
        return self.down.rows // max(self.n_expert, 1)

    def gate_up_storage(self) -> tuple[QuantWeight, int, int]:
        """(the tensor holding the gate rows, a pointer to expert 0's up row 0, rows per expert
        of that storage: ff, or 2 ff for gate_up), as the device kernels address them."""
        ff = self.n_ff
        if self.gate_up is not None:
            base = self.gate_up.data.data_ptr()
            return self.gate_up, base + ff * self.gate_up.data.shape[1], 2 * ff
        assert self.gate is not None and self.up is not None
        return self.gate, self.up.data.data_ptr(), ff

    @property
    def gate_type(self) -> str:
        """The format of the gate and up matrices (they must share one)."""
        w = self.gate_up if self.gate_up is not None else self.gate
        assert w is not None
        return w.type_name


def check_experts(w: ExpertWeights) -> None:
    """ValueError unless ``w``'s tensors have the shapes of E experts of width ff."""
    e, ff = w.n_expert, w.n_ff
    if e <= 0 or ff <= 0:
        raise ValueError(f"ExpertWeights: n_expert {e} and n_ff {ff} must be positive")
    d = w.down.rows // e
    if w.down.rows != e * d or w.down.k != ff:
        raise ValueError(
            f"{w.down.name}: {w.down.rows} x {w.down.k} is not {e} experts of [d, {ff}]"
        )
    if w.gate_up is not None:
        if w.gate is not None or w.up is not None:
            raise ValueError("ExpertWeights: give gate_up or gate and up, not both")
        if w.gate_up.rows != e * 2 * ff or w.gate_up.k != d:
            raise ValueError(
                f"{w.gate_up.name}: {w.gate_up.rows} x {w.gate_up.k} is not {e} experts of "
                f"[2 * {ff}, {d}]"
            )
        return
    if w.gate is None or w.up is None:
        raise ValueError("ExpertWeights: gate and up (or gate_up) are required")
    for m in (w.gate, w.up):
        if m.rows != e * ff or m.k != d:
            raise ValueError(f"{m.name}: {m.rows} x {m.k} is not {e} experts of [{ff}, {d}]")
    if w.gate.type_name != w.up.type_name:
        raise ValueError(
            f"{w.gate.name} is {w.gate.type_name} but {w.up.name} is {w.up.type_name}: "
            "gate and up must share a format"
        )


def check_moe(
    x: torch.Tensor, w: ExpertWeights, experts: torch.Tensor, weights: torch.Tensor
) -> None:
    check_experts(w)
    d = w.n_embd
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"moe.experts: x has shape {list(x.shape)}, expected [N, {d}]")
    if x.dtype != torch.float32:
        raise ValueError(f"moe.experts: x must be float32, got {x.dtype}")
    n = x.shape[0]
    if experts.dim() != 2 or experts.shape[0] != n or not 1 <= experts.shape[1] <= MOE_MAX_KK:
        raise ValueError(
            f"moe.experts: experts has shape {list(experts.shape)}, expected [{n}, 1..{MOE_MAX_KK}]"
        )
    if experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe.experts: experts must be int32 (or int64), got {experts.dtype}")
    if tuple(weights.shape) != tuple(experts.shape) or weights.dtype != torch.float32:
        raise ValueError(
            f"moe.experts: weights must be float32 {list(experts.shape)}, got "
            f"{weights.dtype} {list(weights.shape)}"
        )


def check_residual(residual: torch.Tensor | None, x: torch.Tensor) -> None:
    if residual is not None:
        check_f32("residual", residual)
        if residual.shape != x.shape:
            raise shape_error("residual", residual, str(list(x.shape)))


def check_shared(
    routed: torch.Tensor, shared: torch.Tensor, h: torch.Tensor, gate: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:  # fmt: skip
    """routed, shared, h and residual [N, d], gate [d], all float32."""
    for name, t in (("routed", routed), ("shared", shared), ("h", h)):
        check_f32(name, t)
        if t.dim() != 2 or t.shape != routed.shape:
            raise shape_error(name, t, "[N, d] (as routed)")
    if gate is not None:
        check_f32("gate", gate)
        if gate.shape != routed.shape[1:]:
            raise shape_error("gate", gate, f"[{routed.shape[1]}]")
    check_residual(residual, routed)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * y[:, j] for y [N, kk, d], in the fixed order j = 0, 1, ... with
    elementwise ops only, so each token's sum is the same whatever else is in the batch."""
    out = y[:, 0] * weights[:, 0:1]  # [N, d]
    for j in range(1, y.shape[1]):
        out.addcmul_(y[:, j], weights[:, j : j + 1])
    return out


class MoeTorch:
    """MoE experts on dequantized (cached) weights, in plain PyTorch. Each token's result is
    independent of the rest of the batch on the CPU (``rows_linear``, ``rowwise.silu``)."""

    def __init__(self, dense: DenseWeights) -> None:
        self.dense = dense

    def experts(
        self,
        x: torch.Tensor,
        w: ExpertWeights,
        experts: torch.Tensor,
        weights: torch.Tensor,
        *,
        residual: torch.Tensor | None = None,
        xq: Q8Activations | None = None,
        shared: SharedExpert | None = None,
    ) -> torch.Tensor:
        """residual + sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x), e = experts[:, j].

        x [N, d] fp32, experts [N, kk] int32/int64 (clamped to [0, E)), weights [N, kk] fp32,
        residual [N, d] or None -> [N, d] fp32, every expert on every token (see the module
        docstring). ``xq``: x rounded by ``linear.quantize`` (ignored here). ``shared``: the
        shared expert's output times its gate added before the residual, as ``add_shared``.
        """
        check_moe(x, w, experts, weights)
        check_residual(residual, x)
        n, d, e, ff = x.shape[0], w.n_embd, w.n_expert, w.n_ff
        if w.gate_up is not None:
            gu = rows_linear(x, self.dense(w.gate_up)).view(n, e, 2, ff)  # [N, E, 2, ff]
            g, u = gu[:, :, 0], gu[:, :, 1]  # [N, E, ff]
        else:
            assert w.gate is not None and w.up is not None
            g = rows_linear(x, self.dense(w.gate)).view(n, e, ff)  # [N, E, ff]
            u = rows_linear(x, self.dense(w.up)).view(n, e, ff)
        h = rowwise.silu(g) * u  # [N, E, ff]
        down = self.dense(w.down).view(e, d, ff)  # [E, d, ff]
        y = torch.stack([rows_linear(h[:, i], down[i]) for i in range(e)], dim=1)  # [N, E, d]
        idx = experts.long().clamp(0, e - 1)  # [N, kk]
        sel = torch.gather(y, 1, idx[:, :, None].expand(-1, -1, d))  # [N, kk, d]
        out = combine(sel, weights)
        if shared is not None:
            shared.ready()
            sh = shared.out if shared.gate is None else shared.out * shared.gate[:, None]
            out = out + sh
        return out if residual is None else residual + out

    def add_shared(
        self,
        routed: torch.Tensor,  # [N, d] the routed experts' sum
        shared: torch.Tensor,  # [N, d] the shared expert's output
        h: torch.Tensor,  # [N, d] the layer's input (the gate reads it)
        gate: torch.Tensor | None,  # [d] ffn_gate_inp_shexp, or None (an ungated shared expert)
        residual: torch.Tensor | None = None,  # [N, d]
    ) -> torch.Tensor:  # [N, d]
        """residual + (routed + shared * sigmoid(h . gate)) per token, the reference's
        ``experts_ffn + shared_expert`` (then the block's residual)."""
        check_shared(routed, shared, h, gate, residual)
        if gate is not None:
            shared = shared * rowwise.sigmoid(ops.linear(h, gate[None]))  # [N, 1] gate
        y = routed + shared
        return y if residual is None else residual + y
