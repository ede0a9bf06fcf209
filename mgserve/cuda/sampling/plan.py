"""What a sampling step runs, decided on the host: the plan, and one session's row of inputs.

The plan lets ``DeviceSampler.sample`` run with static shapes and no host sync (a CUDA graph needs
both): which stages run and how candidates are found (``torch.topk`` of a fixed K, a whole-row
sort, or whole rows) is chosen here from the parameters, never from device values. A stage whose
parameters are neutral (``SamplingParams``' conventions, as ``SeqSampler`` reads them) is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.grammar import TokenMask

SORT = -1  # SamplingPlan.candidates: sort each whole row (some row has top_k off and top_p on)
WHOLE = -2  # SamplingPlan.candidates: whole rows unsorted (no row uses top_k or top_p)


class SamplingPlan(NamedTuple):
    """Which stages a step runs and with what shapes: decided on the host, so ``sample`` never
    looks at device values to branch. A plan that is "more" than a batch needs is still correct
    (neutral parameters are exact identities), so a CUDA graph captured with a broad plan (e.g.
    ``SamplingPlan.broad``) serves any batch it covers."""

    candidates: int  # 0: every row greedy; k > 0: torch.topk(k); SORT; WHOLE
    top_p: bool  # some sampling row has top_p < 1
    min_p: bool  # some sampling row has min_p > 0
    penalties: bool  # some row has non-neutral penalties and a non-empty window
    bias: bool  # some row has a logit bias
    n_top: int  # the largest n_probs (0: no top candidates)
    logprob: bool  # some row wants its token's logprob
    mask: bool = False  # some row has a mask (a grammar's, or a forced token's)

    @classmethod
    def broad(cls, n_top: int = 0, logprob: bool = False) -> SamplingPlan:
        """Every stage on, whole-row sort: serves any batch (at the sort's cost)."""
        return cls(SORT, True, True, True, True, n_top, logprob, True)


class SamplingRow(NamedTuple):
    """One session's share of a step, as the runner hands it to ``SamplingBatch.build``."""

    params: SamplingParams
    window: Sequence[int]  # the session's last repeat_last_n context tokens (-1: all of them)
    counter: int  # tokens this session has sampled so far (the draw's position in its stream)
    seed: int | None = None  # overrides params.seed (one of them must be set: see ``seeded``)
    # the session's grammar state, or a token the draw must give: fills its bitmask row
    matcher: TokenMask | None = None


def window_len(r: SamplingRow) -> int:
    """How many of the row's last tokens its penalties look at (repeat_last_n: -1 all, 0 none)."""
    n = r.params.repeat_last_n
    return 0 if n == 0 else len(r.window) if n < 0 else min(n, len(r.window))


def cheapest_plan(
    sampling: list[SamplingParams],
    v: int,
    penalties: bool,
    bias: bool,
    rs: list[SamplingRow],
) -> SamplingPlan:
    """The cheapest plan that is exact for these rows (``sampling``: the non-greedy ones)."""
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in sampling]
    top_p = any(p.top_p < 1.0 for p in sampling)
    if not sampling:
        cand = 0
    elif all(k > 0 for k in ks):
        cand = max(ks)
    elif top_p or any(k > 0 for k in ks):
        cand = SORT
    else:
        cand = WHOLE
    n_top = min(max(r.params.n_probs for r in rs), v)
    logprob = any(r.params.want_logprob for r in rs)
    mask = any(r.matcher is not None for r in rs)
    min_p = any(p.min_p > 0.0 for p in sampling)
    return SamplingPlan(cand, top_p, min_p, penalties, bias, n_top, logprob, mask)
