"""The scheduler-runner contract and the messages around it.

``Request`` goes from the API to the scheduler; ``TokenEvent`` comes back. Each step the scheduler
hands the runner one ``ScheduledBatch`` and gets one ``StepResult``. The single rule "per session,
how many tokens go through the model this step" covers prefill (a prompt chunk), decode (one token)
and speculation (one token plus k draft tokens to verify): see ``SeqWork``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from mgserve.core.engine.reasoning import ReasoningBudget

if TYPE_CHECKING:
    import torch

    from mgserve.core.grammar import Grammar

# the most top candidates a request may ask for per token: the API refuses more, and the device
# runner sizes its host buffers for this many
MAX_N_PROBS = 100


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Neutral values switch a stage off (llama.cpp's conventions)."""

    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    repeat_penalty: float = 1.0  # 1: off; applied over the last repeat_last_n tokens
    repeat_last_n: int = 64  # window for all three penalties (-1: whole context, 0: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a fresh random one per session; the same seed, the same tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans a token
    n_probs: int = 0  # also report the top n_probs (<= MAX_N_PROBS) candidates per sampled token
    want_logprob: bool = False  # report the sampled token's own logprob

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def as_json(self) -> dict[str, object]:
        """As llama-server shows them (/props, /slots): ``logit_bias`` pairs, seed -1 for random."""
        d = dataclasses.asdict(self)
        d["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        d["seed"] = -1 if self.seed is None else self.seed
        return d


@dataclass
class Request:
    """One generation request, tokenized and checked at the API boundary (``api/protocol.py``):
    the engine and the scheduler trust it and do not check it again. Mutable only by the scheduler
    once submitted."""

    id: str  # unique among the engine's open requests
    prompt: list[int]  # token ids, BOS included where the model wants one; 1 <= len < n_ctx
    sampling: SamplingParams
    max_tokens: int  # >= 1; the scheduler also stops at the slot's context end
    stop_token_ids: frozenset[int] = frozenset()  # end-of-generation ids (EOS, EOT, ...)
    ignore_eos: bool = False
    # structured output: every generated token is one the grammar allows; a complete grammar
    # allows only end-of-generation ids, so the request stops there. With ``reasoning``, the
    # grammar starts once the reasoning block is closed.
    grammar: Grammar | None = None
    # a chat template's reasoning block: its markers and the budget of tokens it may hold
    reasoning: ReasoningBudget | None = None
    slot: int | None = None  # 0 <= slot < n_slots: wait for this slot (llama-server's id_slot)
    reuse_prefix: bool = True  # False: compute the whole prompt, whatever a slot holds
    progress: bool = False  # send a ``PromptProgress`` event after each prompt chunk
    # prompt positions where leading messages end (api/message_cuts.py): a recurrent model's
    # prompt chunks also end, and checkpoints are taken, there (checkpoints.py)
    cut_hints: tuple[int, ...] = ()
    # n-gram speculation (mgserve/spec/): False never drafts for this request ("speculative":
    # false); draft_max / draft_min bound a step's drafts (llama-server's speculative.n_max /
    # n_min; None: the server's --spec-k)
    speculative: bool = True
    draft_max: int | None = None
    draft_min: int = 0


class TopLogprob(NamedTuple):
    token: int
    logprob: float


class PromptProgress(NamedTuple):
    """How far a request's prompt is (llama-server's ``prompt_progress``)."""

    total: int  # prompt tokens
    cache: int  # of them reused from the slot's cache
    processed: int  # in the cache now (cache included)
    time_ms: int  # since the prompt's computation started


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (or the end of a request) sent from the scheduler to the API."""

    request_id: str
    token: int | None  # None only on a final event that carries no token (error, abort)
    slot: int | None = None  # the slot serving the request (None: it never left the queue)
    logprob: float | None = None
    top: tuple[TopLogprob, ...] = ()
    finish_reason: str | None = None  # None while running; "stop", "length", "abort", "error"
    n_prompt: int = 0  # prompt tokens (on every event, so usage can be built from the last)
    n_cached: int = 0  # prompt tokens reused from the slot's cache
    n_generated: int = 0  # tokens generated so far, this one included
    error: str | None = None
    # seconds since the request was submitted (llama-server's `timings` are built from it)
    t_prompt_done: float | None = None
    progress: PromptProgress | None = None  # set on a progress event (token None, not final)


@dataclass(frozen=True)
class SeqWork:
    """One session's share of a step: which tokens go through the model, and what comes back."""

    slot: int  # the slot whose state (KV cache, later recurrent state) is read and extended
    request_id: str  # so a stale result (slot reassigned meanwhile) is never applied
    tokens: tuple[int, ...]  # a prompt chunk, one decode token, or (later) 1 + k drafts
    start: int  # position of tokens[0] == tokens already in the slot's cache
    sample: bool  # False for a prompt chunk that does not end the prompt: no logits needed
    sampling: SamplingParams  # the request's params (the runner keeps per-slot RNG + history)
    new_sequence: bool = False  # first work of a request in this slot: reset sampler state
    history: tuple[int, ...] = ()  # with new_sequence: tokens before `start` (penalty window)
    # the request's grammar, on the first draw it constrains (the first sampled token, or the
    # first after the reasoning block closed): the runner starts a Matcher for the session
    grammar: Grammar | None = None
    # this draw must give this token (a spent reasoning budget closing its block): the sampler
    # masks every other token; never while the session's grammar is running
    force: int | None = None
    # recurrent models (checkpoints.py): before the step, load the slot's checkpoint at `start`;
    # after it, keep one of the state at start + len(tokens)
    restore: bool = False
    checkpoint: bool = False
    # speculation (mgserve/spec/): the last ``n_draft`` of ``tokens`` are drafts, tokens[0] the
    # session's real next input. The runner samples after each of the 1 + n_draft positions as
    # if they were decoded one by one (the same draw counters, the same penalty windows) and
    # returns, in order, the sampled tokens while each equals the next draft, plus the first that
    # does not (or the one after the last draft): 1 to 1 + n_draft ``SeqResult``s. The slot then
    # holds tokens[: accepted + 1] past ``start``; later positions are as if never written (a
    # recurrent model's state rolls back to there). Only with ``sample``, never with ``force``,
    # ``grammar`` or ``checkpoint``, and only for a runner whose ``supports_drafts`` is True.
    n_draft: int = 0


class PrefixCopy(NamedTuple):
    """A request placed in slot ``dst`` takes the first ``n`` positions of slot ``src``'s cache
    (busy or idle; it only appends past them): their K/V rows and QSA block keys, and for a
    recurrent model ``src``'s state at ``n`` into ``dst``'s live state, from its checkpoint at
    ``n`` or (``live``) its own live state, which is at ``n`` when the step starts."""

    request_id: str  # the request it serves in ``dst``
    src: int
    dst: int
    n: int
    live: bool = False


class CheckpointMove(NamedTuple):
    """A checkpoint the runner holds, moved by the scheduler's book (checkpoints.py)."""

    slot: int
    pos: int
    to_host: bool  # True: from device memory to host memory; False: drop it


# A slot's state in host memory, by name, in the runner's own layout (``Runner.slot_format``):
# positional rows [0, n) (K/V, QSA block keys), the recurrent state after them, checkpoints.
SlotTensors = Mapping[str, "torch.Tensor"]


class SlotSave(NamedTuple):
    """Copy an idle slot's state to host memory (a slot save); it comes back in
    ``StepResult.saved[id]``."""

    id: str
    slot: int
    tokens: tuple[int, ...]  # what the slot holds: its K/V rows [0, n) and the state after them
    checkpoints: tuple[int, ...]  # positions of the slot's checkpoints to copy with it
    cuts: tuple[int, ...] = ()  # the hint cuts the slot's state was computed under


class SlotLoad(NamedTuple):
    """Write a saved state (``SlotSave``'s tensors) into an idle slot; its checkpoints replace
    the slot's. The runner checks every tensor against the slot's before it writes any."""

    id: str
    slot: int
    tokens: tuple[int, ...]
    checkpoints: tuple[int, ...]  # those of ``tensors`` to keep (the book holds these)
    tensors: SlotTensors


class SlotErase(NamedTuple):
    """An idle slot's cache forgotten: nothing for the runner to do (the book's moves drop its
    checkpoints); it rides a batch so that its answer comes in order with the steps."""

    id: str
    slot: int
    n: int  # tokens the slot held


SlotOp = SlotSave | SlotLoad | SlotErase


@dataclass(frozen=True)
class ScheduledBatch:
    """Everything the runner needs for one step. The runner never looks at the queue.

    The runner applies a step as: ``prefix_copies`` in order (before anything else touches a
    slot, so each reads its source as the previous steps left it), then restores
    (``SeqWork.restore``), then ``checkpoint_moves`` in order, then ``slot_ops``, then the
    forward, then new checkpoints (``SeqWork.checkpoint``). A batch with slot ops carries no
    work. A runner with ``lanes`` (lanes.py) runs a ``lane`` batch (prompt chunks, prefix
    copies, slot ops, moves) beside one other batch (decode tokens only)."""

    step: int  # monotonically increasing; results carry it back
    work: tuple[SeqWork, ...]  # at most one entry per slot
    freed_slots: tuple[int, ...] = ()  # slots released since the last step: drop their state
    checkpoint_moves: tuple[CheckpointMove, ...] = ()
    slot_ops: tuple[SlotOp, ...] = ()
    prefix_copies: tuple[PrefixCopy, ...] = ()
    lane: bool = False  # the prefill lane's batch (lanes.py)


class SeqResult(NamedTuple):
    slot: int
    request_id: str
    token: int  # the sampled token
    logprob: float | None  # its logprob under the unmodified distribution, if asked
    top: tuple[TopLogprob, ...]  # top n_probs candidates, if asked


@dataclass
class StepResult:
    step: int
    # one per SeqWork with sample=True, in work order; a SeqWork with drafts gives 1 + the
    # accepted drafts, consecutive and in order (``SeqWork.n_draft``)
    results: list[SeqResult] = field(default_factory=list)
    n_tokens: int = 0  # tokens that went through the model this step
    seconds: float = 0.0  # wall time of the step on the runner
    saved: dict[str, SlotTensors] = field(default_factory=dict)  # SlotSave.id -> its tensors
    # request id -> why that session alone failed this step (its grammar's matcher: see
    # grammar.matcher.Isolated); it ends with that error, its results here are dropped
    failed: dict[str, str] = field(default_factory=dict)
