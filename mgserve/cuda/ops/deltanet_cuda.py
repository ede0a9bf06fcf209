"""``DeltaNetCuda``: the deltanet family's decode steps on kernels/deltanet.cu (``conv_step_f32``:
one thread per channel; ``delta_step_f32``: one CTA per (32 state columns, value head, session),
the state column in registers; ``delta_gates_f32``: both gates of every token in one launch;
``step_gates`` with ``fused``: ``delta_step_gates_f32``, the step making its gates itself). With
``chains`` (ops/chains.py) the decode kernels take the runs: a run's rows go through the conv and
the recurrence in order, in the CTAs of its first row.
Prefill: kernels/deltanet_chunked.cu (deltanet_prefill_cuda.py) for head dim 128, the torch
version (deltanet_chunked.py on the device) otherwise. Inputs must be float32 (int32 for slots)
on this device."""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.checks import check_cuda, check_index, check_vec4, shape_error
from mgserve.cuda.launch import Kernels
from mgserve.cuda.ops.chains import Chains
from mgserve.cuda.ops.deltanet import (
    DeltaNetTorch,
    check_conv,
    check_gates,
    check_prefill,
    check_step,
    check_step_state,
)
from mgserve.cuda.ops.deltanet_prefill_cuda import (
    PREFILL_HEAD_DIM,
    PREFILL_PIECE,
    SCAN_COLS,
    check_piece,
    check_scan_cols,
    run_prefill,
)

DELTANET_SOURCE = "deltanet.cu"
CONV_THREADS = 128  # channels per CTA of conv_step_f32
GATES_THREADS = 128  # (token, head) pairs per CTA of delta_gates_f32
DELTA_COLS = 32  # DELTA_COLS in deltanet.cu: state columns (lanes) per CTA of delta_step_f32
DELTA_SPLIT = 4  # DELTA_SPLIT in deltanet.cu: warps per CTA, each owning 1/4 of the state rows
MAX_CONV_K = 8  # conv kernel widths the kernel is instantiated for: 1..MAX_CONV_K
MAX_STEP_HEAD_DIM = 256  # delta_step_f32 keeps a state column in registers


def conv_defines(k: int, vec: bool) -> tuple[tuple[str, str], ...]:
    """The -D values of conv_step_f32: width ``k``; ``vec``: weight rows read as float4."""
    return (("CONV_K", str(k)), ("CONV_VEC", str(int(vec))))


def step_defines(head_dim: int) -> tuple[tuple[str, str], ...]:
    """The -D values of delta_step_f32 / delta_step_gates_f32 for ``head_dim``."""
    return (("HEAD_DIM", str(head_dim)),)


class DeltaNetCuda:
    """The decode steps on deltanet.cu, prefill on deltanet_chunked.cu. The signatures are
    DeltaNetTorch's (the family's interface); the shape checks are shared (``check_step``,
    ``check_prefill``)."""

    def __init__(self, kernels: Kernels, fallback: DeltaNetTorch) -> None:
        self.kernels, self.fallback = kernels, fallback
        self.device = kernels.device
        self.prefill_kernels = True  # False: prefill runs the torch version (deltanet_chunked.py)
        self.fused = True  # step_gates in one launch (False: gates, then step)
        self._piece = PREFILL_PIECE
        self._scan_cols = SCAN_COLS
        self._scan_tc = bool(getattr(kernels, "wgmma", False))  # on sm_90 (+2.9% a prompt)

    @property
    def prefill_piece(self) -> int:
        """Prompt tokens per launch triple: any whole number of chunks up to PREFILL_PIECE gives
        the same bits (``check_piece``, which a new value must pass)."""
        return self._piece

    @prefill_piece.setter
    def prefill_piece(self, piece: int) -> None:
        self._piece = check_piece(piece)

    @property
    def scan_cols(self) -> int:
        """State columns per CTA of the prompt's scan (``check_scan_cols``): the same bits at
        either width."""
        return self._scan_cols

    @scan_cols.setter
    def scan_cols(self, cols: int) -> None:
        self._scan_cols = check_scan_cols(cols)

    @property
    def scan_tc(self) -> bool:
        """The prompt's scan on TF32 tensor cores in the 3xTF32 form (deltanet_scan_tc.cu): fp32
        accuracy, not the fp32 scan's bits; ``scan_cols`` is then not used. Only on sm_90 (H100 /
        H200: two CTAs of 113 KB of shared memory an SM), where it is the default (a 4096-token
        qwen4exp prompt 2.9% faster on the H100, BENCHMARKS.md 2026-12-07 05:32); ValueError
        elsewhere."""
        return self._scan_tc

    @scan_tc.setter
    def scan_tc(self, on: bool) -> None:
        if on and not getattr(self.kernels, "wgmma", False):
            raise ValueError(
                "deltanet.scan_tc: the scan on tensor cores runs on sm_90 GPUs (H100 / H200) only"
            )
        self._scan_tc = bool(on)

    def prefill(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        slot: int,
        weight: torch.Tensor,
        *,
        n_k_heads: int,
        n_v_heads: int,
        head_dim: int,
        eps: float,
        chunk: int = 64,
    ) -> torch.Tensor:
        """DeltaNetTorch.prefill on the kernels, in 64-token chunks whatever ``chunk`` says (it
        steers the torch version only). Head dims other than 128, conv widths above MAX_CONV_K
        or ``prefill_kernels`` off: the torch version."""
        check_prefill(qkv, g, beta, conv, ssm, slot, weight, n_k_heads, n_v_heads, head_dim)
        if not self.prefill_kernels or head_dim != PREFILL_HEAD_DIM or weight.shape[1] > MAX_CONV_K:
            return self.fallback.prefill(
                qkv, g, beta, conv, ssm, slot, weight, n_k_heads=n_k_heads, n_v_heads=n_v_heads,
                head_dim=head_dim, eps=eps, chunk=chunk,
            )  # fmt: skip
        qkv, g, beta, weight = (t.contiguous() for t in (qkv, g, beta, weight))
        for name, t in (("qkv", qkv), ("g", g), ("beta", beta), ("weight", weight), ("conv", conv)):
            check_cuda(name, t, self.device, torch.float32)
        check_vec4("ssm", ssm, self.device, torch.float32)
        return run_prefill(
            self.kernels, qkv, g, beta, conv, ssm, slot, weight, n_k_heads=n_k_heads,
            n_v_heads=n_v_heads, eps=eps, piece=self.prefill_piece, scan_cols=self.scan_cols,
            tensor_cores=self.scan_tc,
        )  # fmt: skip

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
        self, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
        chains: Chains | None = None,
    ) -> torch.Tensor:  # fmt: skip
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
        vec = weight.data_ptr() % 16 == 0  # [C, 4] rows as float4 (K = 4)
        self.kernels.launch(
            self.kernels.kernel(DELTANET_SOURCE, "conv_step_f32", conv_defines(k, vec)),
            ((c + CONV_THREADS - 1) // CONV_THREADS, b),
            CONV_THREADS,
            x.data_ptr(),
            conv.data_ptr(),
            slots.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            np.int32(c),
            _runs(chains, b, self.device),
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
        chains: Chains | None = None,
    ) -> torch.Tensor:
        # per-token rows read in place; views (rowwise's padded outputs, slices) are copied
        y, g, beta = (t if t.is_contiguous() else t.contiguous() for t in (y, g, beta))
        for name, t in (("g", g), ("beta", beta)):
            check_cuda(name, t, self.device, torch.float32)
        check_step(y, g, beta, ssm, slots, n_k_heads, n_v_heads, head_dim)
        gates = (g.data_ptr(), beta.data_ptr())
        return self._step("delta_step_f32", y, gates, ssm, slots, n_k_heads, n_v_heads, eps, chains)

    def step_gates(
        self, y: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, dt_bias: torch.Tensor,
        a: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, *, n_k_heads: int,
        n_v_heads: int, head_dim: int, eps: float, chains: Chains | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if not self.fused:  # two launches
            g, beta = self.gates(b, alpha, dt_bias, a)
            return self.step(
                y, g, beta, ssm, slots, n_k_heads=n_k_heads, n_v_heads=n_v_heads,
                head_dim=head_dim, eps=eps, chains=chains,
            )  # fmt: skip
        n, hv = check_gates(b, alpha, dt_bias, a)
        for name, t in (("b", b), ("alpha", alpha)):
            if t.device != self.device or t.stride(-1) != 1:
                raise ValueError(f"{name} must be rows of unit stride on {self.device}")
        check_cuda("dt_bias", dt_bias, self.device, torch.float32)
        check_cuda("a", a, self.device, torch.float32)
        y = y if y.is_contiguous() else y.contiguous()
        if check_step_state(y, ssm, slots, n_k_heads, n_v_heads, head_dim) != n or hv != n_v_heads:
            raise shape_error("b", b, f"[{y.shape[0]}, {n_v_heads}]")
        gates = (b.data_ptr(), np.int64(b.stride(0)), alpha.data_ptr(), np.int64(alpha.stride(0)),
                 dt_bias.data_ptr(), a.data_ptr())  # fmt: skip
        return self._step(
            "delta_step_gates_f32", y, gates, ssm, slots, n_k_heads, n_v_heads, eps, chains
        )

    def _step(
        self, name: str, y: torch.Tensor, gates: tuple[object, ...], ssm: torch.Tensor,
        slots: torch.Tensor, n_k_heads: int, n_v_heads: int, eps: float, chains: Chains | None,
    ) -> torch.Tensor:  # fmt: skip
        """Launch ``name`` (delta_step_f32 or delta_step_gates_f32: ``gates`` are its gate
        arguments) on checked shapes."""
        for t_name, t in (("y", y), ("ssm", ssm)):
            check_cuda(t_name, t, self.device, torch.float32)
        check_cuda("slots", slots, self.device, torch.int32)
        b, head_dim = y.shape[0], ssm.shape[-1]
        if head_dim > MAX_STEP_HEAD_DIM:
            raise ValueError(
                f"deltanet.step: head_dim {head_dim} > {MAX_STEP_HEAD_DIM} (a state column sits "
                "in registers)"
            )
        o = torch.empty((b, n_v_heads, head_dim), dtype=torch.float32, device=self.device)
        if b == 0:
            return o
        self.kernels.launch(
            self.kernels.kernel(DELTANET_SOURCE, name, step_defines(head_dim)),
            ((head_dim + DELTA_COLS - 1) // DELTA_COLS, n_v_heads, b),
            (DELTA_COLS, DELTA_SPLIT),
            y.data_ptr(),
            *gates,
            ssm.data_ptr(),
            slots.data_ptr(),
            o.data_ptr(),
            np.int32(n_k_heads),
            np.int32(n_v_heads),
            np.float32(eps),
            np.float32(head_dim**-0.5),
            _runs(chains, b, self.device),
        )
        return o


def _runs(chains: Chains | None, n: int, device: torch.device) -> int:
    """The kernels' ``runs`` argument: chains.runs' pointer, or null (every row alone)."""
    if chains is None:
        return 0
    check_cuda("runs", chains.runs, device, torch.int32)
    check_index("runs", chains.runs, n)
    return chains.runs.data_ptr()
