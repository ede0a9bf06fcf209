"""Micro-batches of a pipeline's decode step: the step's sessions split into a few contiguous
groups that follow one another through the stages, so that stage i works on group j + 1 while
stage i + 1 works on group j (``StagedLM`` with ``micro_batches`` > 1; on several GPUs, different
users' tokens occupy different GPUs at once).

Decode is batch-invariant (a row's logits are bitwise the same whatever shares its step), so a
row computed in its group has the bits it has in the whole step: splitting changes nothing but
the order of the work. Only decode steps whose rows the model takes alone split: chains of
length one (a recurrent model's speculation runs must stay together: its ops walk a run's rows
in order), nothing logged for a rollback, and host-made rows (``extra``) that are a tensor with
a row per token. An attention-only (rewindable) model's verify step replays its plain graph,
whose chains say every row is alone, and so may split inside a run: safe, as no op of such a
model reads the chains (``last`` is rebased per group only for rows whose run stays in it) and a
later group's rows read the K/V an earlier group wrote, in the same stage, on the same stream.
Prompt chunks never split (a chunk's attention and recurrences run over its tokens in order).
"""

from __future__ import annotations

import dataclasses

import torch

from mgserve.cuda.models.base import Step
from mgserve.cuda.ops.chains import Chains


def splittable(step: Step) -> bool:
    """Whether ``step`` may run as micro-batches (the module docstring)."""
    if not step.decode or step.log is not None or step.logit_rows is not None:
        return False
    if step.chains is not None and step.chains.longest != 1:
        return False
    n = step.tokens.shape[0]
    return step.extra is None or (isinstance(step.extra, torch.Tensor) and step.extra.shape[0] == n)


def groups(n: int, m: int) -> list[tuple[int, int]]:
    """``n`` rows as min(m, n) contiguous groups, sizes differing by at most one (larger first)."""
    m = max(1, min(m, n))
    size, extra = divmod(n, m)
    out, at = [], 0
    for j in range(m):
        end = at + size + (1 if j < extra else 0)
        out.append((at, end))
        at = end
    return out


def sub_step(step: Step, r0: int, r1: int) -> Step:
    """Rows r0..r1 - 1 of a splittable decode step, as a step of their own."""
    ch = step.chains
    chains = (
        None
        if ch is None
        else Chains(ch.runs[r0:r1], ch.depth[r0:r1], ch.last[r0:r1] - r0, ch.longest)
    )
    return dataclasses.replace(
        step,
        tokens=step.tokens[r0:r1],
        pos=step.pos[r0:r1],
        slots=step.slots[r0:r1],
        extra=None if step.extra is None else step.extra[r0:r1],
        lengths=None if step.lengths is None else step.lengths[r0:r1],
        chains=chains,
    )
