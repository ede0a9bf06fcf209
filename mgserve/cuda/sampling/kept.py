"""Sampling batches kept from step to step: a runner's lane refills one preallocated
``SamplingBatch`` per size class (``SamplingBatch.update``) where it built a new one every step:
a device buffer, a pinned staging buffer and two sets of views of them a step, most of the
host's sampling work in a decode step (``mgserve bench sampling-host``; done while the GPU runs
the step's forward, it costs the host's time, not the step's, until the host falls behind).

A class rounds the rows' needs up (rows, window tokens and biased ids to powers of two, a grammar
mask or not), so a session's growing window or a batch's changing size finds its batch again;
its spare rows and slots hold the neutral values, so a row samples what an exactly sized batch
gives it (tests/cuda/test_sampling_kept.py). A batch is reused only in stream order: a lane's
steps run on one stream and end in its one wait, so the next fill finds the last step's sampling
done; each lane keeps its own batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mgserve.cuda.sampling.inputs import SamplingBatch
from mgserve.cuda.sampling.layout import row_sizes
from mgserve.cuda.sampling.plan import SamplingRow

MOST_KEPT = 8  # size classes a lane keeps (the one used longest ago goes first)

SizeClass = tuple[int, int, int, bool]  # (rows, window tokens, biased ids, grammar masks)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length() if n else 0


def size_class(rows: Sequence[SamplingRow], n_vocab: int) -> SizeClass:
    """The batch ``rows`` are sampled with: their needs (``row_sizes``) rounded up."""
    w, nb, mw = row_sizes(rows, n_vocab)
    return _pow2(len(rows)), _pow2(w), _pow2(nb), mw > 0


def kept_batch(
    kept: dict[SizeClass, SamplingBatch], rows: Sequence[SamplingRow], n_vocab: int,
    device: torch.device,
) -> SamplingBatch:  # fmt: skip
    """``rows`` packed into ``kept``'s batch of their size class (made and kept if missing)."""
    if not rows:
        raise ValueError("kept_batch: no rows")
    key = size_class(rows, n_vocab)
    batch = kept.pop(key, None)  # (put back last: the dict's order is the order of use)
    if batch is None:
        if len(kept) >= MOST_KEPT:
            kept.pop(next(iter(kept)))
        b, w, nb, grammar = key
        batch = SamplingBatch.allocate(b, n_vocab, device, w, nb, grammar)
    kept[key] = batch
    return batch.update(rows)
