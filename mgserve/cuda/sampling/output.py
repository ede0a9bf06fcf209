"""A sampling step's result: on the device, and its copy into pinned host buffers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class HostSample(NamedTuple):
    """Pinned host views of one step's SampleOutput; read them after the copy's event."""

    tokens: torch.Tensor  # [B] int32
    logprob: torch.Tensor | None  # [B] f32
    top_ids: torch.Tensor | None  # [B, n] int32
    top_logprobs: torch.Tensor | None  # [B, n] f32


@dataclass(eq=False)
class HostBuffers:
    """Pinned host tensors that SampleOutput.to_host copies into (allocate once, reuse)."""

    tokens: torch.Tensor  # [max_b] int32
    logprob: torch.Tensor  # [max_b] f32
    top_ids: torch.Tensor  # [max_b, max_n] int32
    top_logprobs: torch.Tensor  # [max_b, max_n] f32

    @classmethod
    def allocate(cls, max_b: int, max_n: int = 0, pin: bool | None = None) -> HostBuffers:
        pin = torch.cuda.is_available() if pin is None else pin
        return cls(
            torch.empty(max_b, dtype=torch.int32, pin_memory=pin),
            torch.empty(max_b, dtype=torch.float32, pin_memory=pin),
            torch.empty(max_b, max_n, dtype=torch.int32, pin_memory=pin),
            torch.empty(max_b, max_n, dtype=torch.float32, pin_memory=pin),
        )


class SampleOutput(NamedTuple):
    """One step's result on the device."""

    tokens: torch.Tensor  # [B] int32
    logprob: torch.Tensor | None  # [B] f32: the token's log_softmax under the raw logits
    top_ids: torch.Tensor | None  # [B, n] int32: top n of the raw log_softmax, n = max n_probs
    top_logprobs: torch.Tensor | None  # [B, n] f32

    def to_host(self, buf: HostBuffers) -> HostSample:
        """Start non-blocking copies into ``buf`` on the current stream; returns views of
        ``buf``, valid once an event recorded after this call has completed."""
        b = self.tokens.shape[0]
        if buf.tokens.shape[0] < b:
            raise ValueError(f"to_host: {b} rows > host buffer of {buf.tokens.shape[0]}")
        tokens = buf.tokens[:b]
        tokens.copy_(self.tokens, non_blocking=True)
        logprob = None
        if self.logprob is not None:
            logprob = buf.logprob[:b]
            logprob.copy_(self.logprob, non_blocking=True)
        top_ids = top_lp = None
        if self.top_ids is not None and self.top_logprobs is not None:
            n = self.top_ids.shape[1]
            if buf.top_ids.shape[1] < n:
                raise ValueError(f"to_host: top {n} > host buffer of {buf.top_ids.shape[1]}")
            top_ids, top_lp = buf.top_ids[:b, :n], buf.top_logprobs[:b, :n]
            top_ids.copy_(self.top_ids, non_blocking=True)
            top_lp.copy_(self.top_logprobs, non_blocking=True)
        return HostSample(tokens, logprob, top_ids, top_lp)
