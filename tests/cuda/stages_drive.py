"""The greedy run the pipeline-stage tests compare (test_device_stages.py, and each process of
test_device_stages_dist.py): sessions join one step apart (a prompt chunk beside others' decode
tokens in the same step), then decode together; the tokens each gets and every step's logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork

GREEDY = SamplingParams(temperature=0.0)


def record_logits(model: Any) -> list[torch.Tensor]:
    """Every forward's logits of ``model`` from now on (copies), in order."""
    seen: list[torch.Tensor] = []
    forward = model.forward

    def recorded(step: Any) -> torch.Tensor:
        out = forward(step)
        seen.append(out.detach().to("cpu", copy=True))
        return out

    model.forward = recorded
    return seen


def prompt(session: int, n: int, n_vocab: int) -> list[int]:
    return [(37 * session + 11 * i + 5) % (min(n_vocab, 250) - 10) + 10 for i in range(n)]


Share = Callable[[list[tuple[int, int]]], list[tuple[int, int]]]


def alone(results: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return results


def greedy(runner: Any, sessions: int, n_decode: int, prompt_len: int = 7,
           share: Share = alone) -> list[list[int]]:  # fmt: skip
    """Session s (slot s) starts at step s + 1 with a prompt of prompt_len + 2 s tokens; every
    started session decodes a token per step until it has ``n_decode`` + 1 tokens. ``share``:
    a step's (slot, token) results as the scheduler saw them (across processes: rank 0's, as
    lockstep.py sends its batches; another rank's own draws may be thrown-away ones)."""
    out: list[list[int]] = [[] for _ in range(sessions)]
    pos = [0] * sessions
    step = 0
    while step < sessions or any(len(o) <= n_decode for o in out):
        work = []
        for s in range(sessions):
            if s == step:
                toks = tuple(prompt(s, prompt_len + 2 * s, runner.model.spec.n_vocab))
                work.append(SeqWork(s, f"r{s}", toks, 0, True, GREEDY, new_sequence=True))
            elif s < step and len(out[s]) <= n_decode:
                work.append(SeqWork(s, f"r{s}", (out[s][-1],), pos[s], True, GREEDY))
        step += 1
        results = runner.run(ScheduledBatch(step, tuple(work))).results
        by_slot = dict(share([(r.slot, r.token) for r in results]))
        for w in work:
            out[w.slot].append(by_slot[w.slot])
            pos[w.slot] = w.start + len(w.tokens)
    return out


def verified(runner: Any, want: list[int], k: int = 3, prompt_len: int = 7,
             share: Share = alone) -> list[int]:  # fmt: skip
    """Session 0 of ``greedy`` again (its prompt), its decode steps verifying ``k`` drafts each,
    the drafts being ``want`` (its greedy continuation there): every draft is accepted, so a
    recurrent state keeps them, and a rank that rolled them back would drift. The tokens got."""
    toks = tuple(prompt(0, prompt_len, runner.model.spec.n_vocab))
    first = SeqWork(0, "r0", toks, 0, True, GREEDY, new_sequence=True)
    got = [
        t
        for _, t in share(
            [(r.slot, r.token) for r in runner.run(ScheduledBatch(1, (first,))).results]
        )
    ]
    pos, step = prompt_len, 1
    while len(got) < len(want) - k:
        drafts = tuple(want[len(got) : len(got) + k])
        work = SeqWork(0, "r0", (got[-1], *drafts), pos, True, GREEDY, n_draft=k)
        step += 1
        results = runner.run(ScheduledBatch(step, (work,))).results
        new = [t for _, t in share([(r.slot, r.token) for r in results])]
        got += new
        pos += len(new)
    return got
