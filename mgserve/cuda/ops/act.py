"""The act family: the gated activations, silu(gate) * up (SwiGLU), gelu_tanh(gate) * up
(Gemma's GeGLU) and sigmoid(gate) * up (the output gate of qwen3next's attention), elementwise
over equal shapes.

``ActTorch`` is the reference's ``ops.swiglu`` / ``ops.geglu`` / ``out * rowwise.sigmoid(gate)``;
``ActCuda`` runs kernels/act.cu (float4 loads where rows allow; gate and up may be column slices
of one projection, read in place).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import ops, rowwise
from mgserve.cuda.checks import check_f32, rows_view, vec4_ok
from mgserve.cuda.launch import Kernels

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


class ActCuda:
    """The activations on act.cu; float32 on this device, outputs new contiguous tensors."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self.device = kernels.device

    def _launch(self, name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check_pair(gate, up)
        for t_name, t in (("gate", gate), ("up", up)):
            if t.device != self.device:
                raise ValueError(f"{t_name} is on {t.device}, expected {self.device}")
        shape, f = gate.shape, (gate.shape[-1] if gate.dim() else 1)
        gate, n_rows, g_stride = rows_view(gate, f)
        up, _, u_stride = rows_view(up, f)
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        if out.numel() == 0:
            return out
        vec = f % 4 == 0 and vec4_ok((gate, g_stride), (up, u_stride), (out, f))
        per_row = f // 4 if vec else f
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
        )
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._launch("silu_mul", gate, up)

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._launch("gelu_mul", gate, up)

    def sigmoid_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._launch("sigmoid_mul", gate, up)
