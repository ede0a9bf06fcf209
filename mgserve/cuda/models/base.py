"""What the device models share: the ``Step`` they execute and the ``DeviceLM`` interface.

A step is either

- decode: B sessions, one token each, none at position 0. Everything the step reads is in device
  tensors of shape [B] (tokens, positions, slots), so the same code captures into one CUDA graph
  per B and replays for any sessions, slots and depths; or
- prefill: one or more prompt chunks (``spans``), token-wise work on all their tokens at once and
  the per-session work (attention over the session's cache, recurrences) span by span. Prefill
  runs eagerly and may read host-side span data.

Both write the state of the slots they touch (``SlotPools``) and return logits for the rows asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.cuda.kbase import KVLayer
from mgserve.cuda.pools import SlotPools
from mgserve.cuda.weights import QuantWeight


class Span(NamedTuple):
    slot: int
    start: int  # position of the span's first token
    n: int  # tokens


@dataclass
class Step:
    tokens: torch.Tensor  # [N] int64 token ids (device)
    pos: torch.Tensor  # [N] int32 absolute positions (device)
    slots: torch.Tensor  # [N] int32 slot of each token (device)
    decode: bool  # True: every token is its own session's next token (graph-capturable)
    spans: tuple[Span, ...] = ()  # prefill: the chunks, in token order; decode: unused
    logit_rows: torch.Tensor | None = None  # [R] int64 rows wanting logits; None: every row
    extra: Any = None  # model-specific host-made inputs (qwen4exp: PLE rows [N, n_heads * dim])


class DeviceOps(Protocol):
    """What the device models call: ``backend.TorchBackend`` / ``CudaBackend`` (the methods are
    documented where each op family is defined: matmul.py, smallops.py, attention.py)."""

    def linear(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor: ...
    def dequantize(
        self, w: QuantWeight, row0: int, n_rows: int, out: torch.Tensor
    ) -> torch.Tensor: ...
    def moe_experts(
        self, x: torch.Tensor, w: Any, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...
    def rope(self, x: torch.Tensor, pos: torch.Tensor, **kw: Any) -> torch.Tensor: ...
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    def gated_norm(
        self, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, sigmoid: bool
    ) -> torch.Tensor: ...
    def conv_step(
        self, x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor: ...
    def delta_step(
        self,
        y: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: torch.Tensor,
        slots: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor: ...
    def delta_prefill(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        slot: int,
        weight: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor: ...
    def route(self, logits: torch.Tensor, k: int, norm: bool) -> Any: ...
    def hc_mix(
        self,
        x: torch.Tensor,
        norm: torch.Tensor,
        down: QuantWeight,
        up: QuantWeight,
        inject: QuantWeight | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def hc_combine(
        self, x: torch.Tensor, out: torch.Tensor, inject: torch.Tensor
    ) -> torch.Tensor: ...
    def kv_write(
        self, cache: KVLayer, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor
    ) -> None: ...
    def attention_decode(
        self,
        q: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor: ...
    def attention_prefill(
        self, q: torch.Tensor, k: KVLayer, v: KVLayer, slot: int, start: int, **kw: Any
    ) -> torch.Tensor: ...
    def qsa_decode(
        self,
        q: torch.Tensor,
        iq: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        blocks: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        **kw: Any,
    ) -> torch.Tensor: ...
    def qsa_prefill(
        self,
        q: torch.Tensor,
        iq: torch.Tensor,
        k: KVLayer,
        v: KVLayer,
        blocks: torch.Tensor,
        slot: int,
        start: int,
        **kw: Any,
    ) -> torch.Tensor: ...


class DeviceLM(Protocol):
    spec: ModelSpec
    rewindable: bool
    pools: SlotPools
    weight_bytes: int  # bytes of weights uploaded to the device

    def forward(self, step: Step) -> torch.Tensor:
        """[R, n_vocab] float32 logits of the step's logit rows."""
        ...

    def begin_sequence(self, slot: int) -> None:
        """A new sequence starts at position 0 in ``slot``: reset whatever only goes forward."""
        ...

    def step_extra(self, step_tokens: list[list[int]], slots: list[int]) -> Any:
        """Host-made inputs of a step (e.g. hashed n-gram rows), per span; None if the model
        needs none."""
        ...


def rows(x: torch.Tensor, step: Step) -> torch.Tensor:
    """The rows of ``x`` whose logits the step wants."""
    return x if step.logit_rows is None else x.index_select(0, step.logit_rows)
