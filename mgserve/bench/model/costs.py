"""What an op family call must move and compute at least, for ``bench model --gaps``: the bytes
(weights read at their stored GGUF size, activations and state read and written) and the
floating-point operations (2 x M x N x K for a product) of one call, from its arguments' host-side
metadata only (shapes, dtypes, ``QuantWeight.nbytes``): nothing reads GPU data or waits for it.

``COSTS`` maps ``family.method`` (gaps.annotated's labels) to a function taking the method's own
arguments (the CUDA class's parameter names and order; tests check them) and returning a
``Cost``, or None where the call's cost is not known from the host. Methods without one get no
figures. Counted are the call's inputs and outputs as passed (x in its dtype, not the int8 copy
``xq`` some kernels read instead), never the scratch its kernels use; elementwise and state
arithmetic is not counted as flops (the floor's flop rate is the tensor cores').

Not covered, and why: ``attention.decode`` / ``attention.run_decode`` (the depth is ``lengths``,
a device tensor: the K/V bytes read need a device read), ``qsa.*`` (the selected blocks are chosen
on the device), the DeltaNet steps' and prefill's flops (the recurrence is not a product of known
shape; their bytes are counted), and everything else not in ``COSTS``.

figures.py sums them per label while the work runs and turns them into GB/s, TFLOP/s and floors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Cost(NamedTuple):
    bytes: float  # moved at least: read + written
    flops: float  # floating-point operations of the products (0: none counted)


def _b(*ts: Any) -> int:
    """Bytes of tensors (``QuantWeight``: its stored size); None is nothing."""
    total = 0
    for t in ts:
        if t is None:
            continue
        n = getattr(t, "nbytes", None)
        total += int(n) if n is not None else t.numel() * t.element_size()
    return total


def _product(x: Any, w: Any, bias: Any, residual: Any) -> Cost:
    """x [N, k] (or [k]) times W^T [k, rows], plus bias and residual: W, x, out [N, rows] f32."""
    n = 1 if x.dim() == 1 else x.shape[0]
    if n == 0:  # no rows: nothing read
        return Cost(0.0, 0.0)
    return Cost(_b(w, x, bias, residual) + 4 * n * w.rows, 2.0 * n * w.rows * w.k)


def matvec(w: Any, x: Any, stream: Any = None, out: Any = None, int8: bool = False,
           bias: Any = None, residual: Any = None, xq: Any = None) -> Cost:  # fmt: skip
    """``linear.matvec``: W once, x in, y out."""
    return _product(x, w, bias, residual)


def matmul(x: Any, w: Any, *, bias: Any = None, residual: Any = None, xq: Any = None) -> Cost:
    """``linear.matmul`` (decode rows go through ``linear.matvec``, which then carries the
    figures: ``Tally``): W once for the chunk, x in, y out."""
    return _product(x, w, bias, residual)


def experts(x: Any, w: Any, experts: Any, weights: Any, *, residual: Any = None,
            xq: Any = None, shared: Any = None) -> Cost:  # fmt: skip
    """``moe.experts``: the flops are exact (each token through its kk experts); the bytes count
    kk experts' weights, the number certainly read (a token's kk experts are distinct). N tokens
    read up to min(N kk, E) experts, which only the device's routing says: exact for one token,
    a lower bound for more."""
    n, kk = experts.shape[0], experts.shape[1]
    mats = [m for m in (w.gate, w.up, w.gate_up, w.down) if m is not None]
    e = max(w.n_expert, 1)
    per_expert = sum(m.nbytes for m in mats) / e
    macs = sum(m.rows * m.k for m in mats) / e  # one token through one expert
    used = min(kk, e) if n else 0
    act = _b(x, experts, weights, residual) + 4 * n * w.n_embd
    if shared is not None:  # the shared expert's output (and gates) read by the down kernel
        act += _b(shared.out, shared.gate)
    return Cost(used * per_expert + act, 2.0 * n * kk * macs)


def mix(x: Any, norm: Any, down: Any, up: Any, inject: Any, eps: float) -> Cost:
    """``hc.mix``: the down, up and inject weights once; streams x [N, hc, d] and norm in,
    mixed [N, d] and inject [N, hc] out. Prompt rows run it on ``linear.matmul`` (which then
    carries the figures)."""
    n, hc, d = x.shape
    if n == 0:
        return Cost(0.0, 0.0)
    ws = [m for m in (down, up, inject) if m is not None]
    out = 4 * n * d + (4 * n * hc if inject is not None else 0)
    return Cost(_b(x, norm, *ws) + out, 2.0 * n * sum(m.rows * m.k for m in ws))


def combine_mix(x: Any, out: Any, inject_prev: Any, norm: Any, down: Any, up: Any, inject: Any,
                eps: float) -> Cost:  # fmt: skip
    """``hc.combine_mix``: ``mix`` of the combined streams, plus the previous block's out and
    inject read and the new streams [N, hc, d] written."""
    m = mix(x, norm, down, up, inject, eps)
    return Cost(m.bytes + _b(out, inject_prev, x), m.flops)


def combine(x: Any, out: Any, inject: Any) -> Cost:
    """``hc.combine``: x, out and inject in, the new streams out (elementwise)."""
    return Cost(_b(x, out, inject, x), 0.0)


def rms(x: Any, w: Any, eps: float, residual: Any = None, *, f16: bool = False) -> Cost:
    """``norm.rms``: x, w (and residual) in, y out (x's shape, f32; with ``f16`` its f16 copy
    too, where the CUDA family writes one: counted, as the floor of the bytes it may move)."""
    return Cost(_b(x, w, residual) + (6 if f16 else 4) * x.numel(), 0.0)


def _per_position(kv: Any) -> float:
    """Bytes of one position of a ``KVLayer`` (values and q8_0 scales) in one slot."""
    slots_ctx = kv.values.shape[0] * kv.values.shape[1]
    return (_b(kv.values) + _b(kv.scales)) / max(slots_ctx, 1)


def _visible(start: int, end: int, window: int) -> int:
    """(query, key) pairs of causal queries at positions start..end-1: each sees the keys up to
    its own, the last ``window`` of them when window > 0."""
    full = (end * (end + 1) - start * (start + 1)) // 2  # sum of p + 1
    if window <= 0:
        return full
    ramp_end = min(end, window)  # positions p < window see p + 1 keys
    ramp = (ramp_end * (ramp_end + 1) - start * (start + 1)) // 2 if start < ramp_end else 0
    return ramp + window * (end - max(start, ramp_end))


def prefill(q: Any, k: Any, v: Any, slot: int, start: int, *, scale: float, window: int = 0,
            softcap: float = 0.0) -> Cost:  # fmt: skip
    """``attention.prefill``: the K and V of the positions the chunk sees, once; q in, out
    out; flops of QK^T and PV over the visible (query, key) pairs (2 x 2 x D each per head)."""
    t, h, d = q.shape
    end = start + t
    k0 = max(0, start - window + 1) if window > 0 else 0
    kv = (end - k0) * (_per_position(k) + _per_position(v))
    return Cost(_b(q) * 2 + kv, 4.0 * h * d * _visible(start, end, window))


def _per_slot(pool: Any) -> int:
    """Bytes of one slot's part of a per-slot pool [n_slots, ...] (recurrent state, conv
    history)."""
    return _b(pool) // max(pool.shape[0], 1)


def deltanet_prefill(qkv: Any, g: Any, beta: Any, conv: Any, ssm: Any, slot: int, weight: Any,
                     *, n_k_heads: int, n_v_heads: int, head_dim: int, eps: float,
                     chunk: int = 64) -> Cost:  # fmt: skip
    """``deltanet.prefill``: qkv, gates and conv weight in, the slot's conv history and state
    read and written, out [T, H_v, d] f32; flops not counted (module docstring)."""
    out = 4 * qkv.shape[0] * n_v_heads * head_dim
    return Cost(_b(qkv, g, beta, weight) + 2 * (_per_slot(conv) + _per_slot(ssm)) + out, 0.0)


def _rows_alone(y: Any, chains: Any) -> int:
    """Slots a decode step certainly touches: every row (no chains), else at least one."""
    return y.shape[0] if chains is None else min(1, y.shape[0])


def _step(y: Any, inputs: int, ssm: Any, chains: Any, n_v_heads: int, head_dim: int) -> Cost:
    """A DeltaNet decode step: ``inputs`` bytes in, each touched slot's state read and
    written, o [N, H_v, d] f32 out."""
    o = 4 * y.shape[0] * n_v_heads * head_dim
    return Cost(inputs + 2 * _rows_alone(y, chains) * _per_slot(ssm) + o, 0.0)


def step(y: Any, g: Any, beta: Any, ssm: Any, slots: Any, *, n_k_heads: int, n_v_heads: int,
         head_dim: int, eps: float, chains: Any = None) -> Cost:  # fmt: skip
    """``deltanet.step``: y and gates in, each slot's state read and written, o out."""
    return _step(y, _b(y, g, beta, slots), ssm, chains, n_v_heads, head_dim)


def step_gates(y: Any, b: Any, alpha: Any, dt_bias: Any, a: Any, ssm: Any, slots: Any, *,
               n_k_heads: int, n_v_heads: int, head_dim: int, eps: float,
               chains: Any = None) -> Cost:  # fmt: skip
    """``deltanet.step_gates``: ``step`` with the gates' inputs read instead of g and beta."""
    return _step(y, _b(y, b, alpha, dt_bias, a, slots), ssm, chains, n_v_heads, head_dim)


def conv_step(x: Any, conv: Any, slots: Any, weight: Any, chains: Any = None) -> Cost:
    """``deltanet.conv_step``: x and weight in, each slot's conv history read and written, out."""
    return Cost(_b(x, slots, weight, x) + 2 * _rows_alone(x, chains) * _per_slot(conv), 0.0)


COSTS: dict[str, Callable[..., Cost | None]] = {
    "linear.matvec": matvec,
    "linear.matmul": matmul,
    "moe.experts": experts,
    "hc.mix": mix,
    "hc.combine_mix": combine_mix,
    "hc.combine": combine,
    "norm.rms": rms,
    "attention.prefill": prefill,
    "deltanet.prefill": deltanet_prefill,
    "deltanet.step": step,
    "deltanet.step_gates": step_gates,
    "deltanet.conv_step": conv_step,
}
