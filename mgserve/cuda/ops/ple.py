"""The ple family: what qwen4exp's PLE layer adds to the hyper-connection streams, given each
token's table rows (hashed and gathered on the host, ``mgserve.core.reference.ple``).

There is no PLE kernel: the arithmetic is the reference's (``ple.gate_values``,
``ple.dilated_conv``), run on the backend's own linear and norm families, so one class serves
both backends. The decode conv gathers the slots' histories and runs all B sessions as one batch
of the reference conv (static shapes, sync-free: it captures into a CUDA graph); with ``chains``
(ops/chains.py) each row's history is gathered as it stands before that row of its run.
"""

from __future__ import annotations

import torch

from mgserve.core.reference import ple
from mgserve.cuda.ops.chains import Chains, histories
from mgserve.cuda.ops.linear import LinearTorch
from mgserve.cuda.ops.linear_cuda import LinearCuda
from mgserve.cuda.ops.norm import NormCuda, NormTorch
from mgserve.cuda.weights import QuantWeight


class Ple:
    """The PLE gate and its dilated conv on the backend's linear and norm families."""

    def __init__(self, linear: LinearTorch | LinearCuda, norm: NormTorch | NormCuda) -> None:
        self.linear, self.norm = linear, norm
        # a prompt chunk's table rows go to the device as stored and are decoded there
        # (ple_rows.packed_rows); False: dequantized on the host (compare: bench model --paired
        # R --toggle ple.packed_rows)
        self.packed_rows = True

    def gated(
        self,
        x: torch.Tensor,  # [N, hc, d] streams
        emb: torch.Tensor,  # [N, n_heads * head_dim] the tokens' table rows
        key: QuantWeight,  # [hc * d, n_heads * head_dim]
        value: QuantWeight,  # [d, n_heads * head_dim]
        norm_key: torch.Tensor,  # [hc, d]
        norm_query: torch.Tensor,
        norm_conv: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # gated [N, hc, d], conv input [N, hc * d]
        """``ple.gated_values``: each stream's gate on the shared value, and the conv's input."""
        k, v = self.linear.matmul(emb, key), self.linear.matmul(emb, value)
        return ple.gate_values(x, k, v, norm_key, norm_query, norm_conv, eps, self.norm.rms)

    def conv_decode(
        self,
        x: torch.Tensor,  # [B, C] each session's new conv input
        history: torch.Tensor,  # [n_slots, (K - 1) * dilation, C] (history[slots] advanced)
        slots: torch.Tensor,  # [B] int32, distinct (but for chains' runs)
        weight: torch.Tensor,  # [C, K]
        dilation: int,
        chains: Chains | None = None,
    ) -> torch.Tensor:  # [B, C] silu(conv)
        """One token of ``ple.dilated_conv`` for each of B sessions (a run's rows in order)."""
        idx = slots.long()
        if chains is None or chains.alone:
            y, new = ple.dilated_conv(x[:, None], history.index_select(0, idx), weight, dilation)
            history.index_copy_(0, idx, new)
        else:
            before = histories(history, x, slots, chains)
            y, new = ple.dilated_conv(x[:, None], before, weight, dilation)
            history.index_copy_(0, idx, chains.select(new))  # a run's rows write the same
        return y[:, 0]

    def conv_prefill(
        self,
        x: torch.Tensor,  # [T, C] one session's new conv inputs
        history: torch.Tensor,  # [n_slots, (K - 1) * dilation, C] (history[slot] advanced)
        slot: int,
        weight: torch.Tensor,  # [C, K]
        dilation: int,
    ) -> torch.Tensor:  # [T, C] silu(conv)
        """``ple.dilated_conv`` of one session's chunk."""
        y, history[slot] = ple.dilated_conv(x, history[slot], weight, dilation)
        return y
