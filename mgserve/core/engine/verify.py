"""Verifying drafts in the reference runner: the acceptance rule and the rollback of a recurrent
state (``SeqWork.n_draft``; the scheduler's side is speculation.py).

The rule. A session's verify entry is (x, d1, .., dk): its real next input, then k drafts. The
model gives logits after each of the 1 + k positions; row i is sampled with the session's own
``SeqSampler`` exactly as plain decode would sample it (the penalty window has taken tokens[0..i],
the draw uses the session's generator in the same order), giving y_i. While y_i == d_{i+1} the
draft is accepted and row i + 1 is the step plain decode would have taken next; the first y_i that
differs (or y_k, the bonus token after the last draft) ends the run. The sampler's state then is
the one plain decode has after the same tokens: rows past the end are never drawn.

Why this is the speculative-sampling rule. That rule accepts a draft d proposed with probability
q(d) with probability min(1, p(d) / q(d)) and otherwise samples from max(0, p - q), normalised. An
n-gram draft is deterministic, q = delta_d, so it accepts d with probability p(d) and otherwise
samples from p with d removed, renormalised. Drawing y ~ p and accepting iff y == d does exactly
that: y == d has probability p(d), and y given y != d is p without d, renormalised. Since y is the
very draw plain decode makes (same generator, same order, same penalised and filtered p), the
sampled output is not only equal in distribution but identical, token for token, to speculation
off (up to the rounding of computing k + 1 positions in one forward); greedy is the case p = argmax.

Rollback. K/V rows (and qwen4exp's QSA block keys) are positional: rows past the accepted ones are
rewritten before anything reads them. A recurrent state (DeltaNet, conv, PLE history, pending QSA
keys: ``HybridState.snapshot``) only goes forward, so the runner takes a snapshot before the verify
forward and, when a draft was rejected, restores it and computes tokens[: accepted + 1] again
(no logits). The reference forward keeps no per-position state (its chunked delta rule gives only
the final one), and re-running at most k tokens is cheap next to keeping a state per position on
the CPU; the device runner re-runs only the recurrent ops, on their logged inputs
(cuda/verify.py). The recomputed state is
that of the accepted tokens computed as one chunk, which equals plain decode's up to rounding,
as a state continued past decoded tokens does (checkpoints.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch

from mgserve.core.engine.contract import SeqWork
from mgserve.core.engine.sampling import SeqSampler
from mgserve.core.models.base import CausalLM, SeqInput
from mgserve.core.models.kvcache import KVCache
from mgserve.core.models.state import HybridState


def check(w: SeqWork, sampler: SeqSampler) -> None:
    """ValueError for a verify entry the contract rules out (before anything is computed)."""
    if not w.n_draft:
        return
    if not 0 < w.n_draft < len(w.tokens) or len(w.tokens) != 1 + w.n_draft:
        raise ValueError(f"slot {w.slot}: {w.n_draft} drafts in {len(w.tokens)} tokens")
    bad = [
        name
        for name, on in (
            ("without sample", not w.sample),
            ("with force", w.force is not None),
            ("under a grammar", w.grammar is not None or sampler.matcher is not None),
            ("with a checkpoint", w.checkpoint),
            ("with new_sequence", w.new_sequence),
        )
        if on
    ]
    if bad:
        raise ValueError(f"slot {w.slot}: drafts {', '.join(bad)}")


def sample_drafted(sampler: SeqSampler, logits: torch.Tensor, tokens: Sequence[int]) -> list[int]:
    """The tokens a verify entry gives: ``logits`` [1 + k, V] are the rows after each of
    ``tokens`` (x, d1, .., dk); 1 to 1 + k tokens, all but the last equal to the drafts they
    confirm (see the module docstring)."""
    out: list[int] = []
    for i, tok in enumerate(tokens):
        sampler.accept((tok,))  # in the context now: the window sees it before row i is drawn
        y = sampler.sample(logits[i])
        out.append(y)
        if i + 1 == len(tokens) or y != tokens[i + 1]:
            break
    return out


class Kept(NamedTuple):
    """A recurrent state's snapshot from before a verify forward, to roll it back."""

    state: HybridState
    snap: Any  # the state's own snapshot type (state.py, state_qwen4exp.py)
    start: int


def keep(cache: KVCache, w: SeqWork) -> Kept | None:
    """What to keep before the forward to roll ``w``'s state back: a recurrent state's snapshot
    (None: no drafts, or a positional cache, which needs nothing)."""
    state: object = cache
    if w.n_draft and isinstance(state, HybridState):
        return Kept(state, state.snapshot(), w.start)
    return None


def roll_back(model: CausalLM, states: Sequence[tuple[Kept, tuple[int, ...]]]) -> None:
    """Put each kept state back to its start plus the accepted tokens given with it: the
    snapshot restored, those tokens computed again, all sessions in one forward."""
    seqs = []
    for kept, tokens in states:
        kept.state.restore(kept.snap)
        cache = cast(KVCache, kept.state)
        seqs.append(SeqInput(cache, torch.tensor(tokens, dtype=torch.int64), kept.start, 0))
    if seqs:
        model.forward(seqs)
