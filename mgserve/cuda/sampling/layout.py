"""The packed buffer of a ``SamplingBatch`` (inputs.py): each field's byte offset, dtype and shape,
typed views of it, and how much room a batch's rows need."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mgserve.core.grammar import bitmask_words
from mgserve.cuda.sampling.plan import SamplingRow, window_len


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def layout(
    b: int, w: int, nb: int, mw: int
) -> tuple[dict[str, tuple[int, torch.dtype, tuple]], int]:
    """Byte offset, dtype and shape of every field in the packed buffer; and its total size."""
    fields: list[tuple[str, torch.dtype, tuple]] = [
        ("temperature", torch.float64, (b,)),
        ("seed", torch.int64, (b,)),
        ("counter", torch.int64, (b,)),
        ("top_k", torch.int64, (b,)),
        ("bias_ids", torch.int64, (b, nb)),
        ("top_p", torch.float32, (b,)),
        ("log_min_p", torch.float32, (b,)),
        ("repeat_penalty", torch.float32, (b,)),
        ("frequency_penalty", torch.float32, (b,)),
        ("presence_penalty", torch.float32, (b,)),
        ("bias_values", torch.float32, (b, nb)),
        ("window", torch.int32, (b, w)),
        ("allowed", torch.int32, (b, mw)),
        ("n_probs", torch.int32, (b,)),
        ("greedy", torch.bool, (b,)),
        ("want_logprob", torch.bool, (b,)),
    ]
    out: dict[str, tuple[int, torch.dtype, tuple]] = {}
    off = 0
    for name, dt, shape in fields:
        out[name] = (off, dt, shape)
        off = _align(off + math.prod(shape) * dt.itemsize)
    return out, max(off, 16)


def row_sizes(rs: Sequence[SamplingRow], n_vocab: int) -> tuple[int, int, int]:
    """What ``rs`` need of a batch: window tokens, biased ids and grammar mask words a row."""
    w = max(window_len(r) for r in rs)
    nb = max(len({t for t, _ in r.params.logit_bias if 0 <= t < n_vocab}) for r in rs)
    return w, nb, bitmask_words(n_vocab) if any(r.matcher is not None for r in rs) else 0


def views(raw: torch.Tensor, layout: dict[str, tuple[int, torch.dtype, tuple]]) -> dict:
    """Typed views of the packed uint8 buffer ``raw``, one per field."""
    out = {}
    for name, (off, dt, shape) in layout.items():
        n = math.prod(shape) * dt.itemsize
        out[name] = raw[off : off + n].view(dt).view(shape)
    return out
