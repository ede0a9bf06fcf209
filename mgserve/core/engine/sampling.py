"""Sampling: logits -> one token per row, in llama.cpp's order, on the CPU.

Pipeline per row (llama.cpp's default chain; a neutral parameter switches a stage off):

    logit_bias -> penalties -> grammar mask -> greedy (temperature <= 0: argmax)
    | top_k -> top_p -> min_p -> temperature -> draw

A forced token (``SeqWork.force``, a reasoning budget closing its block) takes the grammar mask's
place: a mask that allows that one token.

Each session owns a ``SeqSampler``: its own ``torch.Generator`` and its own penalty window. A row is
always drawn with its session's generator and nothing else, so the tokens a session gets depend only
on its seed and its logits, never on which other sessions share the step.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Iterable, Sequence

import torch

from mgserve.core.engine.contract import SamplingParams, TopLogprob
from mgserve.core.grammar import ForcedToken, Grammar, Isolated, TokenMask


class PenaltyWindow:
    """The last ``n`` tokens of a session (prompt included) and how often each occurs in them.

    Counts are kept incrementally, so a decode step costs O(1) here whatever the context length.
    """

    def __init__(self, n: int, tokens: Iterable[int] = ()) -> None:
        # n < 0: the whole context; n == 0: off (nothing is remembered)
        self._n = n
        self._tokens: deque[int] = deque(maxlen=None if n < 0 else n)
        self.counts: Counter[int] = Counter()
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        if self._n == 0:
            return
        for t in tokens:
            if self._tokens.maxlen is not None and len(self._tokens) == self._tokens.maxlen:
                old = self._tokens[0]
                self.counts[old] -= 1
                if self.counts[old] == 0:
                    del self.counts[old]
            self._tokens.append(t)
            self.counts[t] += 1


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> None:
    """Add each (token id, bias) to ``logits`` [V] in place; a bias of -inf bans the token."""
    for token, b in bias:
        if 0 <= token < logits.shape[0]:
            logits[token] += b


def apply_penalties(logits: torch.Tensor, counts: Counter[int], p: SamplingParams) -> None:
    """Repeat, frequency and presence penalties on ``logits`` [V], in place, for window tokens.

    Repeat penalty as llama.cpp: a positive logit is divided by it, a negative one multiplied (plain
    division would make a penalized negative logit *more* likely). Frequency and presence as OpenAI:
    subtract ``count * frequency_penalty + presence_penalty``.
    """
    if not counts or (
        p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
    ):
        return
    ids = torch.tensor(list(counts.keys()), dtype=torch.long)  # [U]
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)  # [U]
    ok = ids < logits.shape[0]
    ids, n = ids[ok], n[ok]
    x = logits[ids]
    x = torch.where(x <= 0, x * p.repeat_penalty, x / p.repeat_penalty)
    x = x - n * p.frequency_penalty - p.presence_penalty
    logits[ids] = x


def filter_candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k -> top_p -> min_p on one row [V]; returns (ids [K], logits [K]) sorted descending.

    At least one candidate always survives (llama.cpp's min_keep = 1). top_p and min_p look at the
    distribution at temperature 1, before temperature is applied, as llama.cpp does.
    """
    v = logits.shape[0]
    if 0 < p.top_k < v:
        vals, ids = torch.topk(logits, p.top_k)  # [K], sorted descending
    else:
        vals, ids = torch.sort(logits, descending=True)  # [V]
    if p.top_p < 1.0:
        cum = torch.cumsum(torch.softmax(vals, dim=0), dim=0)  # [K]
        # keep tokens up to and including the first where the running sum reaches top_p
        keep = min(int((cum < p.top_p).sum()) + 1, vals.shape[0])
        vals, ids = vals[:keep], ids[:keep]
    if p.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p)
        keep = max(int((vals >= vals[0] + math.log(p.min_p)).sum()), 1)
        vals, ids = vals[:keep], ids[:keep]
    return ids, vals


def apply_grammar(x: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``x`` [V] with only the ``allowed`` ids [K] kept (the rest -inf), as a new row. A bias that
    banned every allowed token loses to the grammar: then the ``raw`` logits [V] of those ids."""
    vals = x[allowed]  # [K]
    if bool(torch.isneginf(vals).all()):
        vals = raw[allowed].float()
    out = torch.full_like(x, -torch.inf)
    out[allowed] = vals
    return out


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from an already biased and penalized row [V]."""
    if p.greedy:
        return int(torch.argmax(logits))
    ids, vals = filter_candidates(logits, p)
    probs = torch.softmax(vals.double() / p.temperature, dim=0)  # [K]
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


def new_seed() -> int:
    return random.SystemRandom().randrange(2**63)


class SeqSampler:
    """One session's sampling state: parameters, its generator, its penalty window and, under a
    grammar, its matcher (the mask of what may come next)."""

    def __init__(
        self, params: SamplingParams, history: Iterable[int] = (), grammar: Grammar | None = None
    ) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else new_seed()
        self.generator = torch.Generator().manual_seed(self.seed)
        self.window = PenaltyWindow(params.repeat_last_n, history)
        self.matcher = Isolated(grammar.matcher, grammar.n_vocab) if grammar is not None else None

    def start_grammar(self, grammar: Grammar) -> None:
        """From the next draw on, tokens are the grammar's (the scheduler says when)."""
        self.matcher = Isolated(grammar.matcher, grammar.n_vocab)

    def accept(self, tokens: Iterable[int]) -> None:
        """Tokens that entered the session's context (prompt chunks, fed decode tokens)."""
        self.window.extend(tokens)

    def sample(self, logits: torch.Tensor, force: int | None = None) -> int:
        """One token from a raw logits row [V] (not modified); ``force``: the token the draw
        must give (SeqWork.force), through the same mask as a grammar's."""
        p = self.params
        x = logits.float().clone()  # [V]
        apply_logit_bias(x, p.logit_bias)
        apply_penalties(x, self.window.counts, p)
        mask: TokenMask | None = self.matcher
        if force is not None:
            mask = ForcedToken(force, x.shape[0])
        if mask is None:
            return sample_row(x, p, self.generator)
        token = sample_row(apply_grammar(x, logits, mask.allowed()), p, self.generator)
        if self.matcher is not None and force is None:
            self.matcher.advance(token)
        return token


def logprobs_for(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[tuple[float | None, tuple[TopLogprob, ...]]]:
    """The sampled tokens' logprobs and the top candidates, per row of ``logits`` [B, V].

    These come from log_softmax of the *raw* logits, before bias, penalties, filters and
    temperature: they describe what the model thinks, not what the sampler was allowed to pick
    (llama-server's post-sampling probabilities depend on the sampler settings).
    """
    out: list[tuple[float | None, tuple[TopLogprob, ...]]] = []
    rows = [i for i, p in enumerate(params) if p.want_logprob or p.n_probs > 0]
    lp = torch.log_softmax(logits[rows].float(), dim=-1) if rows else None  # [R, V]
    r = 0
    for i, p in enumerate(params):
        if not (p.want_logprob or p.n_probs > 0):
            out.append((None, ()))
            continue
        assert lp is not None
        row = lp[r]
        r += 1
        own = float(row[tokens[i]]) if p.want_logprob else None
        top: tuple[TopLogprob, ...] = ()
        if p.n_probs > 0:
            vals, ids = torch.topk(row, min(p.n_probs, row.shape[0]))
            top = tuple(TopLogprob(int(t), float(v)) for t, v in zip(ids, vals, strict=True))
        out.append((own, top))
    return out
