"""What the device models share: the ``Step`` they execute and the ``DeviceLM`` interface.

A step is either

- decode: B rows, one token each, none at position 0. Everything the step reads is in device
  tensors of shape [B] (tokens, positions, slots), so the same code captures into one CUDA graph
  per B and replays for any sessions, slots and depths. A session has one row, or (a speculation
  verify step) a run of consecutive rows at consecutive positions, which the ops that keep a
  recurrent state take in order (``chains``, ops/chains.py); or
- prefill: one or more prompt chunks (``spans``), token-wise work on all their tokens at once and
  the per-session work (attention over the session's cache, recurrences) span by span. Prefill
  runs eagerly and may read host-side span data.

Both write the state of the slots they touch (``SlotPools``) and return logits for the rows asked.
Models run every op through their ``Backend`` (``backend.<family>.<op>``); the helpers here load
and run what every architecture shares: the token embedding and output projection, the logit rows
and the attention lengths of a step, and the forward as stages of a layer pipeline (``Staged``).
A model built for one stage (a ``Part``: a process of a pipeline across processes) loads only
that stage's layers and their pools, the embedding if it is the first and the head if the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.cuda.loader import Loader
from mgserve.cuda.ops.chains import Chains
from mgserve.cuda.pools import SlotPools
from mgserve.cuda.weights import QuantWeight

if TYPE_CHECKING:
    from mgserve.cuda.backend import Backend
    from mgserve.cuda.plan_sizes import Part

T = TypeVar("T")


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
    lengths: torch.Tensor | None = None  # [N] int32 pos + 1; decode inputs carry it (key_lengths)
    chains: Chains | None = None  # decode: the runs of a slot's rows (None: every row alone)
    # decode: where a recurrent model logs, layer by layer, how to re-run its state updates on
    # some of the step's rows (``Replay``; the runner's rollback after a verify step: verify.py)
    log: list[Replay] | None = None
    # a prompt chunk in the prefill lane: how far the host's launches may run ahead of the GPU,
    # counted in layers (``LaunchWindow``, cuda/runner_lane.py); None: as far as CUDA lets it
    window: Window | None = None

    def layer_done(self) -> None:
        """Called after each layer's launches (every model's ``stage_layers``)."""
        if self.window is not None:
            self.window.mark()


class Window(Protocol):
    def mark(self) -> None: ...


class Replay(Protocol):
    def __call__(self, rows: torch.Tensor, slots: torch.Tensor, chains: Chains) -> None:
        """Re-run one layer's state updates of the step's ``rows`` [R] int64 (their logged
        inputs) on ``slots`` [R] int32, runs as ``chains`` say."""
        ...


class DeviceLM(Protocol):
    spec: ModelSpec
    backend: Backend  # the op families it runs on
    rewindable: bool
    pools: SlotPools
    weight_bytes: int  # bytes of weights uploaded to the device

    def forward(self, step: Step) -> torch.Tensor:
        """[R, n_vocab] float32 logits of the step's logit rows."""
        ...

    def begin_sequence(self, slot: int) -> None:
        """A new sequence starts at position 0 in ``slot``: reset whatever only goes forward."""
        ...

    def step_extra(
        self, step_tokens: list[list[int]], slots: list[int], packed: bool = False
    ) -> Any:
        """Host-made inputs of a step (e.g. hashed n-gram rows), per span; None if the model
        needs none."""
        ...

    def host_state(self, slot: int) -> Any:
        """A copy of what the model keeps of ``slot`` on the host and a checkpoint must hold
        besides the pools' recurrent state (qwen4exp: the PLE token history); None if nothing."""
        ...

    def set_host_state(self, slot: int, state: Any) -> None:
        """Put back what ``host_state`` returned (a checkpoint is restored)."""
        ...


class Staged:
    """A model's forward as stages of a layer pipeline (mgserve/pipeline/staged.py runs them
    apart): ``stage_in`` (the first stage: the embedding, whatever the architecture feeds its
    first layer), ``stage_layers`` (a stage's contiguous layers, on what the previous stage handed
    off: [N, *handoff_shape] float32 per step, the residual stream), ``stage_out`` (the last
    stage: the head, the logits of the step's logit rows). ``forward`` is the one-stage pipeline,
    the code path of every step when nothing is split."""

    spec: ModelSpec
    handoff_shape: tuple[int, ...]  # what crosses a link per token

    def stage_in(self, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def stage_layers(self, x: torch.Tensor, step: Step, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def stage_out(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, step: Step) -> torch.Tensor:
        """[R, n_vocab] float32 logits of the step's logit rows: every layer as one stage."""
        x = self.stage_layers(self.stage_in(step), step, 0, self.spec.n_layer)
        return self.stage_out(x, step)


def rows(x: torch.Tensor, step: Step) -> torch.Tensor:
    """The rows of ``x`` whose logits the step wants (prefill only: decode wants every row)."""
    return x if step.logit_rows is None else x.index_select(0, step.logit_rows)


def key_lengths(step: Step) -> torch.Tensor:
    """[N] int32: how many positions each query attends over (pos + 1). Decode inputs bring them
    from the host (graphs.py), so the graph adds nothing; otherwise computed once per step."""
    if step.lengths is None:
        step.lengths = step.pos + 1
    return step.lengths


def load_embeddings(
    ld: Loader, spec: ModelSpec, backend: Backend, part: Part | None = None
) -> tuple[torch.Tensor | None, QuantWeight | None]:
    """The token embedding as a float32 table [V, d] (dequantized once on the device, so decode
    gathers rows by token id without the host) and the output projection (the embedding's
    quantized weight itself when the model ties them). Of a pipeline stage's ``part`` (None: the
    whole model), only what it runs: the table on the first stage, the projection on the last."""
    first, last = part is None or part.first, part is None or part.last
    tok = None
    if first or (last and spec.tied_output):
        tok = ld.mat("token_embd.weight", (spec.n_embd, spec.n_vocab))
    out = None
    if last:
        out = tok if spec.tied_output else ld.mat("output.weight", (spec.n_embd, spec.n_vocab))
    table = None
    if first and tok is not None:
        table = torch.empty(tok.rows, tok.k, dtype=torch.float32, device=tok.data.device)
        table = backend.linear.dequantize(tok, 0, tok.rows, table)
    return table, out


def loaded(x: T | None, what: str) -> T:
    """``x``, which a pipeline stage that does not load it never reaches (models' ``part``)."""
    if x is None:
        raise RuntimeError(f"{what} is not loaded in this pipeline stage")
    return x


def owned(part: Part | None, n_layer: int) -> range:
    """The layers a model loads: its stage's ``part``, or all."""
    return range(n_layer) if part is None else range(part.start, part.stop)


def fused_matmul(
    b: Backend, x: torch.Tensor, ws: list[QuantWeight], sizes: list[int], xq: Any = None
) -> list[torch.Tensor]:
    """The products of x [N, k] with projections loaded by ``fuse_rows`` (one stacked weight, or
    one weight each): one [N, size] output per projection (column views of one product)."""
    outs = [b.linear.matmul(x, w, xq=xq) for w in ws]
    return outs if len(outs) == len(sizes) else list(outs[0].split(sizes, dim=1))
