"""Sampling on the device: logits [B, V] -> one token per row, the twin of
``core/engine/sampling.py`` (``SeqSampler``'s chain, its stages and its neutral values).

Everything in ``DeviceSampler.sample`` is static-shape and sync-free given the host-side
``SamplingPlan``, so a decode step can capture it into a CUDA graph. The modules, in the order a
step uses them:

    plan.py     SamplingPlan (which stages run, with what shapes) and SamplingRow (one session)
    inputs.py   SamplingBatch: the rows' inputs packed into one device buffer, one copy per step
    layout.py   that buffer's fields (offsets, dtypes, shapes) and what a batch's rows need of it
    kept.py     a runner lane's batches, one per size class, refilled step after step
    rng.py      the counter-based random numbers: a hash of (seed, counter, token id)
    chain.py    the chain: SeqSampler's stages, batched, and the Gumbel-max draw
    sampler.py  DeviceSampler: the chain, greedy rows, logprobs
    output.py   SampleOutput and its copy into pinned HostBuffers
"""

from __future__ import annotations

from mgserve.cuda.sampling.inputs import SamplingBatch
from mgserve.cuda.sampling.output import HostBuffers, HostSample, SampleOutput
from mgserve.cuda.sampling.plan import SORT, WHOLE, SamplingPlan, SamplingRow
from mgserve.cuda.sampling.rng import seeded
from mgserve.cuda.sampling.sampler import DeviceSampler

__all__ = [
    "SORT",
    "WHOLE",
    "DeviceSampler",
    "HostBuffers",
    "HostSample",
    "SampleOutput",
    "SamplingBatch",
    "SamplingPlan",
    "SamplingRow",
    "seeded",
]
