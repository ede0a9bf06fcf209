"""The per-step sampling inputs on the device: ``SamplingBatch``, one packed buffer of B rows.

The small per-step inputs (temperatures, seeds, counters, penalty windows, biases, grammar masks)
travel to the device in one pinned, non-blocking copy, into preallocated buffers if asked, so a
decode step's sampling can be captured into a CUDA graph and replayed with new inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.core.grammar import bitmask_words
from mgserve.cuda.sampling.layout import layout as _layout
from mgserve.cuda.sampling.layout import row_sizes
from mgserve.cuda.sampling.layout import views as _views
from mgserve.cuda.sampling.plan import SamplingPlan, SamplingRow, cheapest_plan, window_len
from mgserve.cuda.sampling.rng import to_int64


@dataclass(eq=False)
class SamplingBatch:
    """Per-step sampling inputs of B rows, on the device (B may exceed the live rows ``n_rows``:
    a preallocated batch has a fixed capacity and its spare rows are neutral greedy rows).

    All tensors are views of one packed device buffer, filled by one host->device copy from a
    pinned staging buffer. Neutral encodings make every stage an exact identity on rows that do
    not use it: top_k 0 (off, also for top_k >= V), top_p +inf, log_min_p -inf, penalties 1/0/0,
    temperature 1.0 on greedy rows (their draw is discarded).
    """

    temperature: torch.Tensor  # [B] f64 (1.0 on greedy rows)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] f32, +inf = off
    log_min_p: torch.Tensor  # [B] f32, float32(log(min_p)), -inf = off
    repeat_penalty: torch.Tensor  # [B] f32
    frequency_penalty: torch.Tensor  # [B] f32
    presence_penalty: torch.Tensor  # [B] f32
    seed: torch.Tensor  # [B] int64
    counter: torch.Tensor  # [B] int64
    window: torch.Tensor  # [B, W] int32: in-vocabulary window tokens, left-aligned, -1 padded
    bias_ids: torch.Tensor  # [B, NB] int64: distinct in-vocabulary ids, padded (see _fill)
    bias_values: torch.Tensor  # [B, NB] f32 (duplicates of an id summed on the host)
    allowed: torch.Tensor  # [B, MW] int32 grammar bitmasks (MW: 0, or ceil(V/32)); -1: all
    n_probs: torch.Tensor  # [B] int32
    want_logprob: torch.Tensor  # [B] bool
    n_rows: int  # live rows (the first n_rows of B)
    n_vocab: int
    plan: SamplingPlan
    host_n_probs: tuple[int, ...]  # per live row, for the runner to slice SampleOutput.top_*
    host_want_logprob: tuple[bool, ...]
    _raw: torch.Tensor  # uint8 [nbytes] on the device: the packed buffer
    _staging: torch.Tensor  # uint8 [nbytes] on the host (pinned for a CUDA device)
    _capacity: tuple[int, int, int, int] | None = None  # (B, W, NB, MW) of a preallocated one
    _copied: torch.cuda.Event | None = None  # the last staging -> device copy (staging reuse)
    _host: dict[str, np.ndarray] | None = None  # staging's fields, viewed at the first fill

    @property
    def size(self) -> int:
        return self.temperature.shape[0]

    @property
    def device(self) -> torch.device:
        return self._raw.device

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow | tuple],
        n_vocab: int,
        device: torch.device | str,
        out: SamplingBatch | None = None,
    ) -> SamplingBatch:
        """The batch of ``rows`` (SamplingRow or plain (params, window, counter[, seed])) on
        ``device``: exactly sized, or written into the preallocated ``out`` (returned)."""
        if out is not None:
            return out.update(rows)
        rs = [SamplingRow(*r) for r in rows]
        if not rs:
            raise ValueError("SamplingBatch.build: no rows")
        batch = cls._empty(len(rs), *row_sizes(rs, n_vocab), n_vocab, torch.device(device))
        return batch._fill(rs)

    @classmethod
    def allocate(
        cls,
        max_rows: int,
        n_vocab: int,
        device: torch.device | str,
        max_window: int = 64,
        max_bias: int = 16,
        grammar: bool = False,
    ) -> SamplingBatch:
        """A batch with fixed capacity (B = max_rows rows, windows up to ``max_window`` tokens,
        up to ``max_bias`` biased ids per row, grammar masks if ``grammar``) to refill with
        ``update`` step after step: its tensors keep their addresses, as a CUDA graph needs."""
        if max_rows < 1 or max_window < 0 or max_bias < 0:
            raise ValueError(f"allocate: bad capacity {max_rows=} {max_window=} {max_bias=}")
        mw = bitmask_words(n_vocab) if grammar else 0
        batch = cls._empty(max_rows, max_window, max_bias, mw, n_vocab, torch.device(device))
        batch._capacity = (max_rows, max_window, max_bias, mw)
        return batch

    @classmethod
    def _empty(
        cls, b: int, w: int, nb: int, mw: int, n_vocab: int, device: torch.device
    ) -> SamplingBatch:
        if n_vocab < 1:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        layout, nbytes = _layout(b, w, nb, mw)
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)  # every byte is copied in
        if device.type == "cuda":
            staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            staging = torch.empty(nbytes, dtype=torch.uint8)
        plan = SamplingPlan(0, False, False, False, False, 0, False)
        return cls(
            **_views(raw, layout),
            n_rows=0,
            n_vocab=n_vocab,
            plan=plan,
            host_n_probs=(),
            host_want_logprob=(),
            _raw=raw,
            _staging=staging,
        )

    def update(self, rows: Sequence[SamplingRow | tuple]) -> SamplingBatch:
        """Refill a preallocated batch with ``rows`` (at most its capacity); returns self."""
        if self._capacity is None:
            raise ValueError("update: this batch was not made by SamplingBatch.allocate")
        rs = [SamplingRow(*r) for r in rows]
        b = self._capacity[0]
        if not 1 <= len(rs) <= b:
            raise ValueError(f"update: {len(rs)} rows for a batch of capacity {b}")
        return self._fill(rs)

    def _fill(self, rs: list[SamplingRow]) -> SamplingBatch:
        """Pack ``rs`` into the staging buffer, copy it to the device, set the plan."""
        b = self.size
        w = self.window.shape[1]
        nb = self.bias_ids.shape[1]
        mw = self.allowed.shape[1]
        v = self.n_vocab
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the staging buffer is done
        if self._host is None:  # (kept: made at every fill they were 80% of a 1-row fill)
            views = _views(self._staging, _layout(b, w, nb, mw)[0])
            self._host = {k: t.numpy() for k, t in views.items()}
        host = self._host
        host["temperature"][:] = 1.0
        host["greedy"][:] = True
        host["top_k"][:] = 0
        host["top_p"][:] = np.inf
        host["log_min_p"][:] = -np.inf
        host["repeat_penalty"][:] = 1.0
        host["frequency_penalty"][:] = 0.0
        host["presence_penalty"][:] = 0.0
        host["seed"][:] = 0
        host["counter"][:] = 0
        host["window"][:] = -1
        host["bias_ids"][:] = 0
        host["bias_values"][:] = 0.0
        host["allowed"][:] = -1
        host["n_probs"][:] = 0
        host["want_logprob"][:] = False

        sampling: list[SamplingParams] = []
        penalties = False
        for i, r in enumerate(rs):
            p = r.params
            seed = r.seed if r.seed is not None else p.seed
            if seed is None:
                raise ValueError(f"row {i}: no seed (give the session one with seeded(params))")
            host["seed"][i] = to_int64(seed)
            host["counter"][i] = r.counter
            host["n_probs"][i] = p.n_probs
            host["want_logprob"][i] = p.want_logprob
            if not p.greedy:
                sampling.append(p)
                host["greedy"][i] = False
                host["temperature"][i] = p.temperature
                host["top_k"][i] = p.top_k if 0 < p.top_k < v else 0
                if p.top_p < 1.0:
                    host["top_p"][i] = p.top_p
                if p.min_p > 0.0:
                    host["log_min_p"][i] = math.log(p.min_p)  # rounded to f32 like SeqSampler's
            # window: the last repeat_last_n tokens; out-of-vocabulary ones never matter
            n = window_len(r)
            if n > w:
                raise ValueError(f"row {i}: penalty window of {n} tokens > capacity {w}")
            toks = np.asarray(r.window[len(r.window) - n :] if n else (), dtype=np.int64)
            toks = toks[(toks >= 0) & (toks < v)]
            host["window"][i, : toks.size] = toks
            neutral = p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0
            if toks.size and not (neutral and p.presence_penalty == 0.0):
                penalties = True
                host["repeat_penalty"][i] = p.repeat_penalty
                host["frequency_penalty"][i] = p.frequency_penalty
                host["presence_penalty"][i] = p.presence_penalty
            # bias: one entry per distinct id (summed); the padding repeats the first entry so a
            # scatter writes each id's one value, whatever order its duplicates land in
            merged: dict[int, float] = {}
            for t, bv in p.logit_bias:
                if 0 <= t < v:
                    merged[t] = merged.get(t, 0.0) + bv
            if len(merged) > nb:
                raise ValueError(f"row {i}: {len(merged)} biased ids > capacity {nb}")
            if merged:
                ids, vals = zip(*merged.items(), strict=True)
                host["bias_ids"][i, : len(ids)] = ids
                host["bias_values"][i, : len(ids)] = vals
                host["bias_ids"][i, len(ids) :] = ids[0]
                host["bias_values"][i, len(ids) :] = vals[0]
            # the row's mask (a grammar's is computed here, while the device runs the forward)
            if r.matcher is not None:
                if not mw:
                    raise ValueError(f"row {i} has a mask; the batch has no room for masks")
                r.matcher.fill(host["allowed"][i])

        self.plan = cheapest_plan(sampling, v, penalties, any(r.params.logit_bias for r in rs), rs)
        self.n_rows = len(rs)
        self.host_n_probs = tuple(r.params.n_probs for r in rs)
        self.host_want_logprob = tuple(r.params.want_logprob for r in rs)
        if self.device.type == "cuda":
            self._raw.copy_(self._staging, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._raw.copy_(self._staging)
        return self

    def rows(self, b: int) -> SamplingBatch:
        """The first ``b`` rows (views; ``n_rows <= b <= size``), for logits of b rows."""
        if not self.n_rows <= b <= self.size:
            raise ValueError(f"logits: {b} rows; the batch has {self.n_rows} live of {self.size}")
        if b == self.size:
            return self
        cut = {
            name: getattr(self, name)[:b]
            for name in (
                "temperature greedy top_k top_p log_min_p repeat_penalty frequency_penalty "
                "presence_penalty seed counter window allowed bias_ids bias_values n_probs "
                "want_logprob"
            ).split()
        }
        return replace(self, **cut)
