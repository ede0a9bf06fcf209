"""``DeltaNetCuda``: the deltanet family's decode steps on kernels/deltanet.cu (``conv_step_f32``:
one thread per channel; ``delta_step_f32``: one CTA per (32 state columns, value head, session),
the state column in registers; ``delta_gates_f32``: both gates of every token in one launch).
Prefill stays the torch version (deltanet_chunked.py on the device). Inputs must be float32
(int32 for slots) on this device."""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.checks import check_cuda, check_index
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.deltanet import (
    DeltaNetTorch,
    check_conv,
    check_gates,
    check_step,
)

DELTANET_SOURCE = "deltanet.cu"
CONV_THREADS = 128  # channels per CTA of conv_step_f32
GATES_THREADS = 128  # (token, head) pairs per CTA of delta_gates_f32
DELTA_COLS = 32  # DELTA_COLS in deltanet.cu: state columns (lanes) per CTA of delta_step_f32
DELTA_SPLIT = 4  # DELTA_SPLIT in deltanet.cu: warps per CTA, each owning 1/4 of the state rows
MAX_CONV_K = 8  # conv kernel widths the kernel is instantiated for: 1..MAX_CONV_K


class DeltaNetCuda:
    """The decode steps on deltanet.cu; ``prefill`` is the torch version's. The signatures are
    DeltaNetTorch's (the family's interface); the shape checks are shared (``check_step``)."""

    def __init__(self, kernels: Kernels, fallback: DeltaNetTorch) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device
        self.prefill = fallback.prefill  # no prefill kernel: the chunked torch rule on the GPU

    def gates(
        self, b: torch.Tensor, alpha: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, hv = check_gates(b, alpha, dt_bias, a)
        for name, t in (("b", b), ("alpha", alpha)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, expected {self.device}")
        check_cuda("dt_bias", dt_bias, self.device, torch.float32)
        check_cuda("a", a, self.device, torch.float32)
        g = torch.empty((n, hv), dtype=torch.float32, device=self.device)
        beta = torch.empty((n, hv), dtype=torch.float32, device=self.device)
        if n:
            self.kernels.launch(
                self.kernels.kernel(DELTANET_SOURCE, "delta_gates_f32"),
                -(-n * hv // GATES_THREADS),
                GATES_THREADS,
                b.data_ptr(),
                np.int64(b.stride(0)),
                alpha.data_ptr(),
                np.int64(alpha.stride(0)),
                dt_bias.data_ptr(),
                a.data_ptr(),
                g.data_ptr(),
                beta.data_ptr(),
                np.int32(n),
                np.int32(hv),
            )
        return g, beta

    def conv_step(
        self, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        k = check_conv(x, conv, weight)
        for name, t in (("x", x), ("conv", conv), ("weight", weight)):
            check_cuda(name, t, self.device, torch.float32)
        b, c = x.shape
        check_index("slots", slots, b)
        check_cuda("slots", slots, self.device, torch.int32)
        if k > MAX_CONV_K:
            raise ValueError(f"conv kernel width {k} > {MAX_CONV_K}")
        out = torch.empty((b, c), dtype=torch.float32, device=self.device)
        if b == 0:
            return out
        vec = "1" if weight.data_ptr() % 16 == 0 else "0"  # [C, 4] rows as float4 (K = 4)
        self.kernels.launch(
            self.kernels.kernel(
                DELTANET_SOURCE, "conv_step_f32", (("CONV_K", str(k)), ("CONV_VEC", vec))
            ),
            ((c + CONV_THREADS - 1) // CONV_THREADS, b),
            CONV_THREADS,
            x.data_ptr(),
            conv.data_ptr(),
            slots.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            np.int32(c),
        )
        return out

    def step(
        self,
        y: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: torch.Tensor,
        slots: torch.Tensor,
        *,
        n_k_heads: int,
        n_v_heads: int,
        head_dim: int,
        eps: float,
    ) -> torch.Tensor:
        # per-token rows read in place; views (rowwise's padded outputs, slices) are copied
        y, g, beta = (t if t.is_contiguous() else t.contiguous() for t in (y, g, beta))
        for name, t in (("y", y), ("g", g), ("beta", beta), ("ssm", ssm)):
            check_cuda(name, t, self.device, torch.float32)
        b = check_step(y, g, beta, ssm, slots, n_k_heads, n_v_heads, head_dim)
        check_cuda("slots", slots, self.device, torch.int32)
        if head_dim > 256:
            raise ValueError(
                f"deltanet.step: head_dim {head_dim} > 256 (a state column sits in registers)"
            )
        o = torch.empty((b, n_v_heads, head_dim), dtype=torch.float32, device=self.device)
        if b == 0:
            return o
        self.kernels.launch(
            self.kernels.kernel(DELTANET_SOURCE, "delta_step_f32", (("HEAD_DIM", str(head_dim)),)),
            ((head_dim + DELTA_COLS - 1) // DELTA_COLS, n_v_heads, b),
            (DELTA_COLS, DELTA_SPLIT),
            y.data_ptr(),
            g.data_ptr(),
            beta.data_ptr(),
            ssm.data_ptr(),
            slots.data_ptr(),
            o.data_ptr(),
            np.int32(n_k_heads),
            np.int32(n_v_heads),
            np.float32(eps),
            np.float32(head_dim**-0.5),
        )
        return o
