"""Chunked prefill beside decoders at a latency target: how many prompt tokens a step carries.

With ``--itl-target-ms`` set and sessions decoding, each step carries the prompt tokens that keep
the step, and so the decoders' inter-token latency, near the target. ``StepCost`` models a step's
seconds as ``base + per_token * prompt_tokens`` for the number of sessions decoding in it, fitted
by weighted least squares over the recent steps the engine actor measured (the newest weigh most,
so the model follows the cost as depths grow); ``PrefillPacer`` turns the time the target leaves
into a token budget. Nobody decoding, or no target: a whole ``batch_size`` per step.

The budget never moves a cut: a prompt is cut into chunks where it always is (checkpoints.py's
``chunk_end``), and with a target each chunk into pieces of ``QUANTUM`` tokens counted from the
chunk's start; a step carries the whole pieces its budget holds, from where the session is, or
none. Cuts are a function of the prompt and the settings, never of the load, and the reference
runner computes a chunk in pieces to the same bits as whole (the chunked delta rule works in
blocks of 64 from a call's start; attention and products are per token), so outputs do not
depend on the target. On the GPU that holds as far as its prefill is batch-invariant.

What whole pieces leave of a budget is carried to the next step (at most a piece more), so a
prompt progresses at the rate the target leaves on average and a step exceeds the target by less
than a piece; a budget under one piece (a slow model, a tight target) is saved up until a piece
fits, at least one every ``MIN_STEPS`` steps even when decoding alone takes longer than the target
(no prompt waits forever). Cold start: the budget grows from one piece to at most twice the
largest prompt share seen at this decoder count, so a step never extrapolates the model far.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

QUANTUM = 64  # tokens per piece: the chunked delta rule's block (core/reference/deltanet.py)
WINDOW = 32  # steps the cost model remembers
DECAY = 0.85  # weight of a step relative to the next newer one
MIN_STEPS = 8  # a prompt beside decoders gets at least a piece every MIN_STEPS steps
_SPREAD = 0.1  # prompt shares varying less than this (relative std) give no slope


class _Step(NamedTuple):
    n_decode: int  # sessions that decoded one token
    n_prompt: int  # prompt tokens
    seconds: float


class StepCost:
    """Seconds of a step with prompt tokens, as ``base + per_token * prompt_tokens``, per count
    of decoding sessions: a line through the recent such steps (weighted least squares). While
    their prompt shares hardly vary (the steady state) the slope of the last spread stays and the
    line goes through the newest steps; before any spread, through the steps without prompt
    tokens (an over-estimate when a prompt step has fixed costs of its own: the budget is then
    cautious until the shares spread)."""

    def __init__(self) -> None:
        self.steps: deque[_Step] = deque(maxlen=WINDOW)
        self._fits: dict[int, tuple[float, float]] = {}  # n_decode -> (base, per_token)
        self._slopes: dict[int, float] = {}  # n_decode -> the last slope fitted from a spread

    def observe(self, n_decode: int, n_prompt: int, seconds: float) -> None:
        self.steps.append(_Step(n_decode, n_prompt, seconds))
        n = len(self.steps)
        pts = [(DECAY ** (n - 1 - i), s) for i, s in enumerate(self.steps)]
        pts = [(w, s) for w, s in pts if s.n_decode == n_decode]
        mixed = [(w, s) for w, s in pts if s.n_prompt]
        if not mixed:
            return
        n_mean, t_mean, var, cov = _moments(mixed)
        if var > (_SPREAD * n_mean) ** 2 and cov > 0:
            self._slopes[n_decode] = cov / var
        slope = self._slopes.get(n_decode)
        if slope is None:
            alone = [s.seconds for _, s in pts if not s.n_prompt]
            level = statistics.fmean(alone) if alone else 0.0
            slope = max(t_mean - level, 1e-3 * t_mean) / n_mean
        self._fits[n_decode] = (t_mean - slope * n_mean, slope)

    def fit(self, n_decode: int) -> tuple[float, float] | None:
        """(base seconds, seconds per prompt token) beside ``n_decode`` decoders; None until a
        step with prompt tokens at that count was seen."""
        return self._fits.get(n_decode)

    def max_prompt(self, n_decode: int) -> int:
        return max((s.n_prompt for s in self.steps if s.n_decode == n_decode), default=0)


def _moments(pts: list[tuple[float, _Step]]) -> tuple[float, float, float, float]:
    """Weighted means of prompt tokens and seconds, the tokens' variance, their covariance."""
    total = sum(w for w, _ in pts)
    n_mean = sum(w * s.n_prompt for w, s in pts) / total
    t_mean = sum(w * s.seconds for w, s in pts) / total
    var = sum(w * (s.n_prompt - n_mean) ** 2 for w, s in pts) / total
    cov = sum(w * (s.n_prompt - n_mean) * (s.seconds - t_mean) for w, s in pts) / total
    return n_mean, t_mean, var, cov


class PrefillPacer:
    """The scheduler's prompt-token budget per step (``target`` seconds; 0: off)."""

    def __init__(self, target: float, batch_size: int) -> None:
        if target < 0:
            raise ValueError(f"bad latency target: {target}")
        self.target = target
        self.batch_size = batch_size
        self.cost = StepCost()
        self.credit = 0.0  # budget not yet spent: whole pieces round it down
        self._planned: dict[int, tuple[int, int]] = {}  # step -> (n_decode, n_prompt)

    def budget(self, n_decode: int) -> int:
        """Prompt tokens the next step may carry beside ``n_decode`` decoding sessions."""
        if not self.target or not n_decode:
            self.credit = 0.0
            return self.batch_size
        cap = min(self.batch_size, max(QUANTUM, 2 * self.cost.max_prompt(n_decode)))
        fit = self.cost.fit(n_decode)
        allowed = float(cap)
        if fit is not None:
            base, per_token = fit
            allowed = min(allowed, max(QUANTUM / MIN_STEPS, (self.target - base) / per_token))
        self.credit = min(self.credit + allowed, allowed + QUANTUM)
        return int(self.credit)

    def piece_end(self, chunk_start: int, done: int, chunk_end: int, budget: int) -> int:
        """Where a step that may carry ``budget`` tokens of the chunk ``[chunk_start, chunk_end)``
        from ``done`` stops: the chunk's end, else the last piece end that fits (``done``: none)."""
        if chunk_end - done <= budget:
            return chunk_end
        if not self.target:
            return done  # whole chunks only
        return max(done, chunk_start + (done + budget - chunk_start) // QUANTUM * QUANTUM)

    def planned(self, step: int, n_decode: int, n_prompt: int) -> None:
        """The step as scheduled: its budget is spent, its measured time awaited."""
        if self.target:
            self.credit = max(0.0, self.credit - n_prompt) if n_decode else 0.0
            self._planned[step] = (n_decode, n_prompt)

    def observe(self, step: int, seconds: float) -> None:
        """The measured seconds of a planned step (from its planning to its tokens delivered)."""
        shape = self._planned.pop(step, None)
        if shape is not None:
            self.cost.observe(*shape, seconds)

    def discard(self, step: int) -> None:
        """A step that failed: its time says nothing."""
        self._planned.pop(step, None)
