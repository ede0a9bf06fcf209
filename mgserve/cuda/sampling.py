"""Sampling on the device: logits [B, V] -> one token per row, the twin of
``core/engine/sampling.py``.

The chain is ``SeqSampler``'s (llama.cpp's default order; a neutral parameter switches a stage off):

    logit_bias -> penalties -> greedy (temperature <= 0: argmax) | top_k -> top_p -> min_p
    -> temperature -> draw

What differs is the draw. ``SeqSampler`` keeps a ``torch.Generator`` per session; here the random
numbers are a pure function of (seed, counter, token id): a splitmix64 hash on int64 tensors gives
each candidate token a uniform number, and the token is picked by the Gumbel-max trick
(``argmax(logit / T + Gumbel)``, which is exactly a draw from ``softmax(logit / T)`` over the kept
candidates). So a session's token depends only on its logits, its parameters, its seed and how many
tokens it has sampled so far: never on the other sessions of the batch, on B, or on which candidate
set size the batch needed. The same seed gives the same tokens as another run of this sampler, not
the same tokens as ``SeqSampler`` (another random stream, the same distribution).

Everything in ``DeviceSampler.sample`` is static-shape and sync-free given the host-side
``SamplingPlan`` (shapes and which stages run are decided on the host when the batch is built), so a
decode step can capture it into a CUDA graph. ``SamplingBatch`` carries the small per-step inputs to
the device in one pinned, non-blocking copy, into preallocated buffers if asked.

Cost at V = 248320 (float32 logits, B <= 8): each [B, V] elementwise pass moves ~8 MB (~2-4 us
on an H200). The common case (every sampling row has 0 < top_k < V) is: bias and penalties on a
few hundred entries (gather/scatter), one argmax and one ``torch.topk(K)`` over [B, V], then a
few dozen tiny ops on [B, K]. A row with top_k off and top_p < 1 needs the whole row sorted: one
``torch.sort`` of [B, V] (a segmented radix sort, roughly 0.1-0.3 ms) plus softmax, cumsum and
the hash over [B, V] (~20 passes of 8-16 MB, another ~0.1 ms). Rows with top_k and top_p both off
skip the sort but still hash the whole row. logprobs cost one log_softmax over [B, V] (+ a topk).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from mgserve.core.engine.contract import SamplingParams

# ---------------------------------------------------------------------------------------------
# seeds and the counter-based hash
# ---------------------------------------------------------------------------------------------

_U64 = 1 << 64


def _i64(c: int) -> int:
    """A Python int taken mod 2^64 and read as a signed int64 (torch has no uint64 arithmetic)."""
    c %= _U64
    return c - _U64 if c >= 1 << 63 else c


GOLDEN = _i64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def new_session_seed() -> int:
    """A fresh random seed for a session whose request gave none (drawn once, when it starts)."""
    return random.SystemRandom().randrange(2**63)


def seeded(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: its own, or a fresh one. The runner calls this once per session, so
    the session's whole stream of draws follows from the returned params."""
    return params if params.seed is not None else replace(params, seed=new_session_seed())


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s`` (torch's >> on signed ints is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on an int64 tensor (mod 2^64 arithmetic, read as signed).

    Relies on int64 add/mul wrapping around, which torch's CPU and CUDA kernels do."""
    z = z + GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def splitmix64_int(z: int) -> int:
    """The same function on a Python int (the tests' oracle); returns an unsigned 64-bit value."""
    z = (z + 0x9E3779B97F4A7C15) % _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    return z ^ (z >> 31)


def row_keys(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """int64 [B]: one key per (seed, counter), the start of that draw's splitmix64 stream."""
    return splitmix64(splitmix64(seed) ^ counter)


def uniforms(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 [B, K] in (0, 1): the uniform number of token ``ids`` [B, K] (or [1, K]) in the
    stream of ``key`` [B]. Output ``i`` of the stream is ``splitmix64(key + i * GOLDEN)`` (exactly
    the splitmix64 generator), of which the top 52 bits make ``(m + 0.5) / 2^52``: never 0 or 1,
    so the Gumbel noise -log(-log(u)) is always finite."""
    h = splitmix64(key[:, None] + ids * GOLDEN)  # [B, K]
    m = _srl(h, 12).double()  # [B, K] 52-bit integers, exact in float64
    return (m + 0.5) * (2.0**-52)


# ---------------------------------------------------------------------------------------------
# the per-step inputs
# ---------------------------------------------------------------------------------------------

SORT = -1  # SamplingPlan.candidates: sort each whole row (some row has top_k off and top_p on)
WHOLE = -2  # SamplingPlan.candidates: whole rows unsorted (no row uses top_k or top_p)
COUNT_BY_COMPARE_MAX_W = 256  # penalty windows up to this wide are counted by a [B, W, W] compare


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

    @classmethod
    def broad(cls, n_top: int = 0, logprob: bool = False) -> SamplingPlan:
        """Every stage on, whole-row sort: serves any batch (at the sort's cost)."""
        return cls(SORT, True, True, True, True, n_top, logprob)


class SamplingRow(NamedTuple):
    """One session's share of a step, as the runner hands it to ``SamplingBatch.build``."""

    params: SamplingParams
    window: Sequence[int]  # the session's last repeat_last_n context tokens (-1: all of them)
    counter: int  # tokens this session has sampled so far (the draw's position in its stream)
    seed: int | None = None  # overrides params.seed (one of them must be set: see ``seeded``)


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def _layout(b: int, w: int, nb: int) -> tuple[dict[str, tuple[int, torch.dtype, tuple]], int]:
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


def _views(raw: torch.Tensor, layout: dict[str, tuple[int, torch.dtype, tuple]]) -> dict:
    """Typed views of the packed uint8 buffer ``raw``, one per field."""
    out = {}
    for name, (off, dt, shape) in layout.items():
        n = math.prod(shape) * dt.itemsize
        out[name] = raw[off : off + n].view(dt).view(shape)
    return out


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
    n_probs: torch.Tensor  # [B] int32
    want_logprob: torch.Tensor  # [B] bool
    n_rows: int  # live rows (the first n_rows of B)
    n_vocab: int
    plan: SamplingPlan
    host_n_probs: tuple[int, ...]  # per live row, for the runner to slice SampleOutput.top_*
    host_want_logprob: tuple[bool, ...]
    _raw: torch.Tensor  # uint8 [nbytes] on the device: the packed buffer
    _staging: torch.Tensor  # uint8 [nbytes] on the host (pinned for a CUDA device)
    _capacity: tuple[int, int, int] | None = None  # (B, W, NB) of a preallocated batch
    _copied: torch.cuda.Event | None = None  # the last staging -> device copy (staging reuse)

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
        w = max(_window_len(r) for r in rs)
        nb = max(len({t for t, _ in r.params.logit_bias if 0 <= t < n_vocab}) for r in rs)
        batch = cls._empty(len(rs), w, nb, n_vocab, torch.device(device))
        return batch._fill(rs)

    @classmethod
    def allocate(
        cls,
        max_rows: int,
        n_vocab: int,
        device: torch.device | str,
        max_window: int = 64,
        max_bias: int = 16,
    ) -> SamplingBatch:
        """A batch with fixed capacity (B = max_rows rows, windows up to ``max_window`` tokens,
        up to ``max_bias`` biased ids per row) to refill with ``update`` step after step: its
        tensors keep their addresses, as a CUDA graph needs."""
        if max_rows < 1 or max_window < 0 or max_bias < 0:
            raise ValueError(f"allocate: bad capacity {max_rows=} {max_window=} {max_bias=}")
        batch = cls._empty(max_rows, max_window, max_bias, n_vocab, torch.device(device))
        batch._capacity = (max_rows, max_window, max_bias)
        return batch

    @classmethod
    def _empty(cls, b: int, w: int, nb: int, n_vocab: int, device: torch.device) -> SamplingBatch:
        if n_vocab < 1:
            raise ValueError(f"n_vocab must be positive, got {n_vocab}")
        layout, nbytes = _layout(b, w, nb)
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
        b, w, nb = self._capacity
        if not 1 <= len(rs) <= b:
            raise ValueError(f"update: {len(rs)} rows for a batch of capacity {b}")
        return self._fill(rs)

    def _fill(self, rs: list[SamplingRow]) -> SamplingBatch:
        """Pack ``rs`` into the staging buffer, copy it to the device, set the plan."""
        b = self.size
        w = self.window.shape[1]
        nb = self.bias_ids.shape[1]
        v = self.n_vocab
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the staging buffer is done
        layout, nbytes = _layout(b, w, nb)
        host = {k: t.numpy() for k, t in _views(self._staging, layout).items()}
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
        host["n_probs"][:] = 0
        host["want_logprob"][:] = False

        sampling: list[SamplingParams] = []
        penalties = False
        for i, r in enumerate(rs):
            p = r.params
            seed = r.seed if r.seed is not None else p.seed
            if seed is None:
                raise ValueError(f"row {i}: no seed (give the session one with seeded(params))")
            host["seed"][i] = _i64(seed)
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
            n = _window_len(r)
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

        self.plan = _plan(sampling, v, penalties, any(r.params.logit_bias for r in rs), rs)
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
            raise ValueError(
                f"logits have {b} rows; the batch has {self.n_rows} live of {self.size}"
            )
        if b == self.size:
            return self
        cut = {
            name: getattr(self, name)[:b]
            for name in (
                "temperature greedy top_k top_p log_min_p repeat_penalty frequency_penalty "
                "presence_penalty seed counter window bias_ids bias_values n_probs want_logprob"
            ).split()
        }
        return replace(self, **cut)


def _window_len(r: SamplingRow) -> int:
    n = r.params.repeat_last_n
    return 0 if n == 0 else len(r.window) if n < 0 else min(n, len(r.window))


def _plan(
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
    return SamplingPlan(
        cand, top_p, any(p.min_p > 0.0 for p in sampling), penalties, bias, n_top, logprob
    )


# ---------------------------------------------------------------------------------------------
# the chain
# ---------------------------------------------------------------------------------------------


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] plus ``values`` [B, NB] at ``ids`` [B, NB], as a new tensor.

    Ids are distinct per row except for padding, which repeats a real (id, value) pair (or adds
    0.0 to id 0 on a row without bias): every write to one id carries the same value, so the
    scatter is deterministic."""
    return logits.scatter(1, ids, logits.gather(1, ids) + values)


def apply_penalties(
    x: torch.Tensor,
    window: torch.Tensor,
    repeat: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repeat, frequency and presence penalties on ``x`` [B, V] for the tokens of ``window``
    [B, W] (-1 padded), as a new tensor; the same arithmetic as ``core.sampling.apply_penalties``
    (a positive logit divided by the repeat penalty, a negative one multiplied; then
    ``- count * frequency - presence``), in the same float32 order.

    Every window entry rewrites its token's logit with the penalized value; a padding entry
    points at the row's first token and so writes that token's value again (a row with an empty
    window rewrites token 0 with itself). Counts come from a [B, W, W] comparison for short
    windows, from a [B, V] histogram (exact float adds of 1) for long ones."""
    b, v = x.shape
    wn = window.shape[1]
    win = window.long()  # [B, W]
    valid = win >= 0
    idx = torch.where(valid, win, win[:, :1].clamp(min=0))  # [B, W]
    if wn <= COUNT_BY_COMPARE_MAX_W:
        count = (idx[:, :, None] == win[:, None, :]).sum(-1, dtype=torch.float32)  # [B, W]
    else:
        hist = torch.zeros(b, v + 1, dtype=torch.float32, device=x.device)  # [B, V + 1]
        hist.scatter_add_(1, torch.where(valid, win, v), torch.ones_like(win, dtype=torch.float32))
        count = hist.gather(1, idx)  # [B, W]
    g = x.gather(1, idx)  # [B, W]
    pen = torch.where(g <= 0, g * repeat[:, None], g / repeat[:, None])
    pen = pen - count * frequency[:, None] - presence[:, None]
    return x.scatter(1, idx, torch.where(count > 0, pen, g))


def modified_logits(logits: torch.Tensor, batch: SamplingBatch, plan: SamplingPlan) -> torch.Tensor:
    """float32 [B, V]: ``logits`` after logit_bias and penalties (the input is never modified)."""
    x = logits
    if plan.bias and batch.bias_ids.shape[1]:
        x = apply_logit_bias(x, batch.bias_ids, batch.bias_values)
    if plan.penalties and batch.window.shape[1]:
        x = apply_penalties(
            x,
            batch.window,
            batch.repeat_penalty,
            batch.frequency_penalty,
            batch.presence_penalty,
        )
    return x


def filter_candidates_batch(
    x: torch.Tensor, batch: SamplingBatch, plan: SamplingPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_k -> top_p -> min_p on the biased, penalized ``x`` [B, V], per row.

    Returns (ids [B, K], vals [B, K], keep [B, K] bool): the candidate ids and their logits
    (sorted descending unless ``plan.candidates == WHOLE``, where ids is arange(V) as [1, V]) and
    which survive every filter; row i keeps exactly the tokens of ``core.sampling.
    filter_candidates`` (ties at a cut and last-ulp differences of softmax/cumsum aside), and at
    least one. K is plan.candidates (topk), V (SORT, WHOLE). Greedy rows' output is meaningless.
    """
    b, v = x.shape
    if plan.candidates == WHOLE:
        ids = torch.arange(v, device=x.device)[None, :]  # [1, V]
        keep = torch.ones_like(x, dtype=torch.bool)
        if plan.min_p:
            mx = x.max(dim=1, keepdim=True).values  # [B, 1]
            thr = torch.minimum(mx + batch.log_min_p[:, None], mx)  # min_p > 1 keeps the top
            keep = x >= thr
        return ids, x, keep
    if plan.candidates == SORT:
        vals, ids = torch.sort(x, dim=1, descending=True, stable=True)  # [B, V]
    elif plan.candidates > 0:
        vals, ids = torch.topk(x, min(plan.candidates, v), dim=1)  # [B, K] sorted descending
    else:
        raise ValueError(f"filter_candidates_batch: plan has no candidates ({plan})")
    k = vals.shape[1]
    pos = torch.arange(k, device=x.device)[None, :]  # [1, K]
    top_k = batch.top_k[:, None]  # [B, 1]
    keep = (top_k <= 0) | (pos < top_k)  # [B, K]
    if plan.top_p:
        probs = torch.softmax(torch.where(keep, vals, -torch.inf), dim=1)  # [B, K]
        cum = torch.cumsum(probs, dim=1)
        # SeqSampler keeps count(cum < top_p) + 1 tokens (cum is nondecreasing: a prefix)
        n_below = (cum < batch.top_p[:, None]).sum(dim=1, keepdim=True)  # [B, 1]
        keep = keep & (pos <= n_below)
    if plan.min_p:
        thr = vals[:, :1] + batch.log_min_p[:, None]  # [B, 1] float32, as SeqSampler rounds it
        keep = keep & ((vals >= thr) | (pos == 0))
    return ids, vals, keep


def draw(
    ids: torch.Tensor,
    vals: torch.Tensor,
    keep: torch.Tensor,
    batch: SamplingBatch,
) -> torch.Tensor:
    """int64 [B]: per row, a token from softmax(vals / temperature) over the kept candidates,
    by Gumbel-max with the noise of (seed, counter, token id): deterministic, and the same
    whichever candidate list (topk size, sort, whole row) the batch needed."""
    key = row_keys(batch.seed, batch.counter)  # [B]
    u = uniforms(key, ids)  # [B, K]
    gumbel = -torch.log(-torch.log(u))
    score = vals.double() / batch.temperature[:, None] + gumbel  # [B, K]
    score = torch.where(keep, score, -torch.inf)
    j = score.argmax(dim=1, keepdim=True)  # [B, 1]
    if ids.shape[0] == 1 and vals.shape[0] != 1:  # WHOLE: the position is the id
        return j[:, 0]
    return ids.gather(1, j)[:, 0]


# ---------------------------------------------------------------------------------------------
# the sampler and its output
# ---------------------------------------------------------------------------------------------


class HostSample(NamedTuple):
    """Pinned host views of one step's SampleOutput; read them after the copy's event."""

    tokens: torch.Tensor  # [B] int32
    logprob: torch.Tensor | None  # [B] f32
    top_ids: torch.Tensor | None  # [B, n] int32
    top_logprobs: torch.Tensor | None  # [B, n] f32


@dataclass(eq=False)
class HostBuffers:
    """Pinned host tensors that SampleOutput.to_host copies into (allocate once, reuse)."""

    tokens: torch.Tensor  # [max_b] int32
    logprob: torch.Tensor  # [max_b] f32
    top_ids: torch.Tensor  # [max_b, max_n] int32
    top_logprobs: torch.Tensor  # [max_b, max_n] f32

    @classmethod
    def allocate(cls, max_b: int, max_n: int = 0, pin: bool | None = None) -> HostBuffers:
        pin = torch.cuda.is_available() if pin is None else pin
        return cls(
            torch.empty(max_b, dtype=torch.int32, pin_memory=pin),
            torch.empty(max_b, dtype=torch.float32, pin_memory=pin),
            torch.empty(max_b, max_n, dtype=torch.int32, pin_memory=pin),
            torch.empty(max_b, max_n, dtype=torch.float32, pin_memory=pin),
        )


class SampleOutput(NamedTuple):
    """One step's result on the device."""

    tokens: torch.Tensor  # [B] int32
    logprob: torch.Tensor | None  # [B] f32: the token's log_softmax under the raw logits
    top_ids: torch.Tensor | None  # [B, n] int32: top n of the raw log_softmax, n = max n_probs
    top_logprobs: torch.Tensor | None  # [B, n] f32

    def to_host(self, buf: HostBuffers) -> HostSample:
        """Start non-blocking copies into ``buf`` on the current stream; returns views of
        ``buf``, valid once an event recorded after this call has completed."""
        b = self.tokens.shape[0]
        if buf.tokens.shape[0] < b:
            raise ValueError(f"to_host: {b} rows > host buffer of {buf.tokens.shape[0]}")
        tokens = buf.tokens[:b]
        tokens.copy_(self.tokens, non_blocking=True)
        logprob = None
        if self.logprob is not None:
            logprob = buf.logprob[:b]
            logprob.copy_(self.logprob, non_blocking=True)
        top_ids = top_lp = None
        if self.top_ids is not None and self.top_logprobs is not None:
            n = self.top_ids.shape[1]
            if buf.top_ids.shape[1] < n:
                raise ValueError(f"to_host: top {n} > host buffer of {buf.top_ids.shape[1]}")
            top_ids, top_lp = buf.top_ids[:b, :n], buf.top_logprobs[:b, :n]
            top_ids.copy_(self.top_ids, non_blocking=True)
            top_lp.copy_(self.top_logprobs, non_blocking=True)
        return HostSample(tokens, logprob, top_ids, top_lp)


class DeviceSampler:
    """logits [B, V] + SamplingBatch -> SampleOutput, on the logits' device, without a host sync.

    Stateless: every per-session state (seed, counter, penalty window) comes in the batch."""

    def sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        plan: SamplingPlan | None = None,
    ) -> SampleOutput:
        """Sample one token per row of ``logits`` (float32 [B, V], not modified) with the rows
        of ``batch`` (B between its live rows and its size); ``plan`` overrides batch.plan (a
        CUDA graph captured with a broad plan serves narrower batches)."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32 [B, V], got {logits.dtype} {logits.shape}")
        if logits.shape[1] != batch.n_vocab:
            raise ValueError(f"logits have V={logits.shape[1]}, the batch n_vocab={batch.n_vocab}")
        if logits.device != batch.device:
            raise ValueError(f"logits on {logits.device}, the batch on {batch.device}")
        batch = batch.rows(logits.shape[0])
        plan = batch.plan if plan is None else plan

        x = modified_logits(logits, batch, plan)  # [B, V]
        greedy = x.argmax(dim=1)  # [B] int64, the first maximum
        if plan.candidates == 0:
            tokens = greedy
        else:
            ids, vals, keep = filter_candidates_batch(x, batch, plan)
            tokens = torch.where(batch.greedy, greedy, draw(ids, vals, keep, batch))

        logprob = top_ids = top_lp = None
        if plan.logprob or plan.n_top > 0:
            lp = torch.log_softmax(logits, dim=1)  # [B, V] of the raw logits
            if plan.logprob:
                logprob = lp.gather(1, tokens[:, None])[:, 0]
            if plan.n_top > 0:
                top_lp, top = torch.topk(lp, min(plan.n_top, lp.shape[1]), dim=1)
                top_ids = top.int()
        return SampleOutput(tokens.int(), logprob, top_ids, top_lp)
