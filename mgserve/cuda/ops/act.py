"""The act family: the gated activations, silu(gate) * up (SwiGLU), gelu_tanh(gate) * up
(Gemma's GeGLU) and sigmoid(gate) * up (the output gate of qwen3next's attention), elementwise
over equal shapes.

``ActTorch`` is the reference's ``ops.swiglu`` / ``ops.geglu`` / ``out * rowwise.sigmoid(gate)``;
``ActCuda`` runs kernels/act.cu (float4 loads where rows allow; gate and up may be column slices
of one projection, read in place). The ``*_xq`` forms also return the output rounded to int8
groups for the int8 products that read it (``linear.quantize``'s result, written by the same
kernel: one launch fewer); the torch version has no int8 form and returns None.
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import ops, rowwise
from mgserve.cuda.checks import check_f32, rows_view, vec4_ok
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.f16_rows import F16Rows
from mgserve.cuda.ops.linear_tuning import Q8_GROUP, Q8Activations

ACT_SOURCE = "act.cu"
ACT_THREADS = 256  # threads per CTA of the activation kernels (one float4 or float each)


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_f32("gate", gate)
    check_f32("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ in shape")


class ActTorch:
    """The activations in PyTorch on the tensors' device."""

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (the SwiGLU MLP activation), same shape."""
        _check_pair(gate, up)
        return ops.swiglu(gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (Gemma's GeGLU), same shape."""
        _check_pair(gate, up)
        return ops.geglu(gate, up)

    def sigmoid_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """up * sigmoid(gate) (an output gate), same shape."""
        _check_pair(gate, up)
        return up * rowwise.sigmoid(gate)

    def silu_mul_xq(
        self, gate: torch.Tensor, up: torch.Tensor, *, xq: bool
    ) -> tuple[torch.Tensor, None]:
        return self.silu_mul(gate, up), None

    def sigmoid_mul_xq(
        self, gate: torch.Tensor, up: torch.Tensor, *, xq: bool
    ) -> tuple[torch.Tensor, None]:
        return self.sigmoid_mul(gate, up), None


class ActCuda:
    """The activations on act.cu; float32 on this device, outputs new contiguous tensors."""

    def __init__(self, kernels: Kernels, f16: F16Rows | None = None) -> None:
        self.kernels = kernels
        self.device = kernels.device
        self.f16 = f16  # prompt rows: an f16 copy of out for the product that reads it

    def _launch(
        self, name: str, gate: torch.Tensor, up: torch.Tensor, xq: bool = False
    ) -> tuple[torch.Tensor, Q8Activations | None]:
        """out, and with ``xq`` (_v4 rows of F % 32 == 0 only, else None) out rounded to int8
        as [out.shape[0], the rest] (tokens first). Without, prompt rows (``F16Rows.wanted``)
        get out's f16 copy too: a down or output projection reads every gated activation."""
        _check_pair(gate, up)
        for t_name, t in (("gate", gate), ("up", up)):
            if t.device != self.device:
                raise ValueError(f"{t_name} is on {t.device}, expected {self.device}")
        shape, f = gate.shape, (gate.shape[-1] if gate.dim() else 1)
        gate, n_rows, g_stride = rows_view(gate, f)
        up, _, u_stride = rows_view(up, f)
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        if out.numel() == 0:
            return out, None
        vec = f % 4 == 0 and vec4_ok((gate, g_stride), (up, u_stride), (out, f))
        per_row = f // 4 if vec else f
        q, q8_args = None, tuple[int, ...]()
        if xq and vec and f % Q8_GROUP == 0:
            n_tok = shape[0]
            k = out.numel() // n_tok
            q = Q8Activations(
                torch.empty(n_tok, k, dtype=torch.int8, device=self.device),
                torch.empty(n_tok, k // Q8_GROUP, dtype=torch.float32, device=self.device),
            )
            name, q8_args = f"{name}_q8", (q.q.data_ptr(), q.d.data_ptr())
        out16 = None
        if vec and q is None and shape and self.f16 is not None:
            out16 = self.f16.room(out, shape[0])
        if out16 is not None:
            name, q8_args = f"{name}_f16", (out16.data_ptr(),)
        self.kernels.launch(
            self.kernels.kernel(ACT_SOURCE, f"{name}_f32{'_v4' if vec else ''}"),
            (n_rows, (per_row + ACT_THREADS - 1) // ACT_THREADS),
            ACT_THREADS,
            gate.data_ptr(),
            np.int64(g_stride),
            up.data_ptr(),
            np.int64(u_stride),
            out.data_ptr(),
            np.int32(f),
            *q8_args,
        )
        if out16 is not None:
            self.f16.offer(out, out16)  # type: ignore[union-attr]
        return out, q

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._launch("silu_mul", gate, up)[0]

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._launch("gelu_mul", gate, up)[0]

    def sigmoid_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._launch("sigmoid_mul", gate, up)[0]

    def silu_mul_xq(
        self, gate: torch.Tensor, up: torch.Tensor, *, xq: bool
    ) -> tuple[torch.Tensor, Q8Activations | None]:
        return self._launch("silu_mul", gate, up, xq)

    def sigmoid_mul_xq(
        self, gate: torch.Tensor, up: torch.Tensor, *, xq: bool
    ) -> tuple[torch.Tensor, Q8Activations | None]:
        return self._launch("sigmoid_mul", gate, up, xq)
