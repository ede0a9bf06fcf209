"""The stage plan of a layer pipeline: which GPU holds which contiguous range of layers, sized
by memory and balanced by time, before anything is loaded.

- Memory per stage is the memory plan's (mgserve/cuda/plan.py) for a ``Part``: the stage's
  layers' weights, K/V, QSA block keys, recurrent state and device checkpoints for the slots,
  its own workspace; the first stage also holds the token embedding (and takes the host's token
  ids, positions and the PLE rows gathered from the host table when the PLE layer is there: it
  is layer 1), the last one the output head, its norms and the sampler.
- Balance: a stage's load is the sum of its layers' costs, the head's added to the last; by
  default a layer costs the weight bytes one decode token reads (what bounds decode), measured
  stage times can replace that (``Balance.from_times``). The split minimises the busiest stage's
  load among the splits whose every stage fits its GPU (exact, by dynamic programming).
- ``--tensor-split 3,3,2,1,2,2`` instead gives each GPU that share of the layers (llama.cpp's).

A plan that does not fit raises ``StagePlanError`` naming the GPU and what to lower.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache

from mgserve.config import Settings
from mgserve.cuda.plan import Item, ModelSizes, Part, device_total, human, plan
from mgserve.cuda.plan_fit import PlanError, lowering
from mgserve.pipeline.costs import ModelCosts
from mgserve.settings_checks import GPU_BATCHES


class StagePlanError(PlanError):
    """The stages need more memory than their GPUs have."""


@dataclass(frozen=True)
class Stage:
    index: int
    device: int  # CUDA ordinal
    part: Part  # its layers, and whether it holds the embedding (first) or the head (last)
    items: tuple[Item, ...]  # its memory plan
    free: int  # bytes its GPU may use
    source: str  # where ``free`` comes from
    load: float  # its balance cost

    @property
    def layers(self) -> range:
        return range(self.part.start, self.part.stop)

    @property
    def total(self) -> int:
        return device_total(list(self.items))


@dataclass(frozen=True)
class Balance:
    """What a layer costs a stage (``layers``), and the head on the last stage, in ``unit``."""

    layers: tuple[float, ...]
    head: float
    unit: str

    @classmethod
    def decode_bytes(cls, costs: ModelCosts) -> Balance:
        """The default: weight bytes a decode token reads."""
        return cls(tuple(costs.decode_weights()), float(costs.head_bytes), "bytes/token")

    def cost(self, start: int, stop: int) -> float:
        head = self.head if stop == len(self.layers) else 0.0
        return sum(self.layers[start:stop]) + head

    def from_times(self, ranges: Sequence[tuple[int, int]], seconds: Sequence[float]) -> Balance:
        """Per-layer times from measured per-stage ``seconds`` of a plan split at ``ranges``: each
        stage's time shared among its layers (and the head) in proportion to this balance."""
        if len(ranges) != len(seconds):
            raise ValueError(f"{len(seconds)} stage times for {len(ranges)} stages")
        layers, head = list(self.layers), self.head
        for (a, b), t in zip(ranges, seconds, strict=True):
            scale = t / self.cost(a, b)
            layers[a:b] = [x * scale for x in layers[a:b]]
            if b == len(layers):
                head *= scale
        return Balance(tuple(layers), head, "s")


@dataclass(frozen=True)
class StagePlan:
    arch: str
    stages: tuple[Stage, ...]
    how: str  # how the layers were split
    balance: Balance
    ple_layer: int | None  # the layer that adds the PLE rows the host gathers (qwen4exp)
    handoff_bytes: int  # per token, over each link between stages
    host_bytes: int  # per token, from the host to the first stage
    settings: Settings

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.part.start, s.part.stop) for s in self.stages]

    def stage_of(self, layer: int) -> Stage:
        return next(s for s in self.stages if layer in s.part)


def split_shares(n_layer: int, shares: Sequence[float]) -> list[tuple[int, int]]:
    """Layer ranges in proportion to ``shares`` (cumulative, rounded), each at least a layer."""
    n = len(shares)
    if n > n_layer:
        raise ValueError(f"{n} GPUs for {n_layer} layers: every GPU needs a layer")
    total, cum, bounds = sum(shares), 0.0, [0]
    for i, share in enumerate(shares[:-1], 1):
        cum += share
        bounds.append(min(max(round(n_layer * cum / total), bounds[-1] + 1), n_layer - (n - i)))
    bounds.append(n_layer)
    return list(zip(bounds, bounds[1:], strict=False))


def best_split(n_layer: int, n_stages: int, cost: Callable[[int, int], float],
               fits: Callable[[int, int, int], bool]) -> list[tuple[int, int]] | None:  # fmt: skip
    """The contiguous split into ``n_stages`` ranges of at least one layer whose largest
    ``cost(start, stop)`` is least among those where ``fits(stage, start, stop)`` for every
    stage; None when none fits."""
    inf = float("inf")
    # best[s][b]: the least busiest load of stages 0..s covering layers [0, b); cut: its start
    best = [[inf] * (n_layer + 1) for _ in range(n_stages)]
    cut = [[0] * (n_layer + 1) for _ in range(n_stages)]
    for b in range(1, n_layer - n_stages + 2):
        if fits(0, 0, b):
            best[0][b] = cost(0, b)
    for s in range(1, n_stages):
        for b in range(s + 1, n_layer - (n_stages - 1 - s) + 1):
            for a in range(s, b):
                if best[s - 1][a] == inf or not fits(s, a, b):
                    continue
                load = max(best[s - 1][a], cost(a, b))
                if load < best[s][b]:
                    best[s][b], cut[s][b] = load, a
    if best[-1][n_layer] == inf:
        return None
    out, b = [], n_layer
    for s in range(n_stages - 1, -1, -1):
        a = cut[s][b] if s else 0
        out.append((a, b))
        b = a
    return out[::-1]


def _memory(sizes: ModelSizes, settings: Settings) -> Callable[[int, int], int]:
    """Device bytes of the stage of layers [start, stop) (ends by where it lies)."""
    n = sizes.spec.n_layer

    @cache
    def need(start: int, stop: int) -> int:
        return device_total(plan(sizes, settings, Part(start, stop, start == 0, stop == n)))

    return need


def _greedy(n: int, free: Sequence[int], need: Callable[[int, int], int]) -> list[tuple[int, int]]:
    """Each GPU in order takes the most layers that fit it (leaving one for each after it); the
    ranges taken, up to the first GPU that cannot take one (empty: none can)."""
    out, a = [], 0
    for s, room in enumerate(free):
        top = n - (len(free) - 1 - s)
        b = a
        while b < top and need(a, b + 1) <= room:
            b += 1
        if b == a:
            break
        out.append((a, b))
        a = b
    return out


def _feasible(sizes: ModelSizes, free: Sequence[int]) -> Callable[[Settings], bool]:
    n = sizes.spec.n_layer
    return lambda s: sum(b - a for a, b in _greedy(n, free, _memory(sizes, s))) == n


def _ends(part: Part) -> str:
    ends = [" and the token embedding"] * part.first + [" and the output head"] * part.last
    return f"layers {part.start}-{part.stop - 1}" + "".join(ends)


def fitted_plan(costs: ModelCosts, settings: Settings, devices: Sequence[int],
                free: Sequence[tuple[int, str]], split: Sequence[float] | None = None
                ) -> StagePlan:  # fmt: skip
    """``stage_plan``, with an automatic ``--batch-size`` (0) the first of GPU_BATCHES the
    stages hold (the plan's settings carry it; the launcher gives it to every rank); the last
    one's StagePlanError where none does."""
    *tries, last = GPU_BATCHES if not settings.batch_size else (settings.batch_size,)
    for b in tries:
        with contextlib.suppress(StagePlanError):
            return stage_plan(costs, replace(settings, batch_size=b), devices, free, split)
    return stage_plan(costs, replace(settings, batch_size=last), devices, free, split)


def stage_plan(costs: ModelCosts, settings: Settings, devices: Sequence[int],
               free: Sequence[tuple[int, str]], split: Sequence[float] | None = None,
               balance: Balance | None = None) -> StagePlan:  # fmt: skip
    """The stages of ``costs``'s model over ``devices`` (CUDA ordinals, pipeline order) with
    ``free[i]`` = (bytes, where from) on each; ``split``: ``--tensor-split`` shares, else the
    balanced split; ``balance``: per-layer costs (default: decode weight bytes)."""
    sizes, s = costs.sizes, settings
    n, k = sizes.spec.n_layer, len(devices)
    if len(free) != k:
        raise ValueError(f"{len(free)} memory sizes for {k} GPUs")
    bal = balance or Balance.decode_bytes(costs)
    need, room = _memory(sizes, s), [f for f, _ in free]
    if split is not None:
        if len(split) != k:
            raise ValueError(f"tensor-split gives {len(split)} shares for {k} GPUs")
        ranges = split_shares(n, split)
        how = "--tensor-split " + ",".join(f"{x:g}" for x in split)
        for i, (a, b) in enumerate(ranges):
            if need(a, b) > room[i]:
                _refuse_split(sizes, s, devices, free, ranges, i)
    else:
        if k > n:
            raise ValueError(f"{k} GPUs for {n} layers: every GPU needs a layer")
        found = best_split(n, k, bal.cost, lambda i, a, b: need(a, b) <= room[i])
        if found is None:
            _refuse(sizes, s, devices, free)
        ranges = found or []
        how = (
            f"balanced by {'measured time' if bal.unit == 's' else 'weight bytes per decode token'}"
        )
    stages = tuple(
        Stage(i, devices[i], pt, tuple(plan(sizes, s, pt)), free[i][0], free[i][1], bal.cost(a, b))
        for i, (a, b) in enumerate(ranges)
        for pt in [Part(a, b, a == 0, b == n)]
    )
    qp = sizes.qp
    ple = qp.ple.layer if qp is not None and qp.ple is not None else None
    return StagePlan(
        sizes.spec.arch, stages, how, bal, ple, costs.handoff_bytes, costs.host_bytes, s
    )


def _refuse_split(sizes: ModelSizes, s: Settings, devices: Sequence[int],
                  free: Sequence[tuple[int, str]], ranges: list[tuple[int, int]],
                  i: int) -> None:  # fmt: skip
    """StagePlanError for the ``--tensor-split`` stage ``i`` that does not fit its GPU."""
    n, (a, b), (room, source) = sizes.spec.n_layer, ranges[i], free[i]
    need = _memory(sizes, s)
    top = a
    while top < n and need(a, top + 1) <= room:
        top += 1
    part = Part(a, b, a == 0, b == n)

    def fits(s2: Settings) -> bool:
        need2 = _memory(sizes, s2)
        return all(need2(x, y) <= free[j][0] for j, (x, y) in enumerate(ranges))

    options = [f"give it fewer layers with --tensor-split (at most {top - a} from layer {a} fit)"]
    options += lowering(s, fits, sizes.rewindable)
    raise StagePlanError(
        f"GPU {devices[i]} (stage {i}: {_ends(part)}) needs {human(need(a, b))}; "
        f"{human(room)} ({source}): " + ", or ".join(options)
    )


def _refuse(sizes: ModelSizes, s: Settings, devices: Sequence[int],
            free: Sequence[tuple[int, str]]) -> None:  # fmt: skip
    """StagePlanError when no split fits: filling the GPUs in order, the first that cannot take
    what it must, and what to lower."""
    n, room = sizes.spec.n_layer, [f for f, _ in free]
    need = _memory(sizes, s)
    taken = _greedy(n, room, need)
    if len(taken) < len(room):  # GPU i cannot take even one layer
        i, a = len(taken), taken[-1][1] if taken else 0
        part = Part(a, a + 1, a == 0, a + 1 == n)
        what = f"GPU {devices[i]} cannot hold even {_ends(part)}: it needs {human(need(a, a + 1))}"
    else:  # every GPU took layers, and some are left after the last
        i, a = len(room) - 1, taken[-1][0]
        part = Part(a, n, a == 0, True)
        what = f"GPU {devices[i]} would need {human(need(a, n))} for {_ends(part)}"
    if i:
        listed = ", ".join(str(d) for d in devices[:i])
        what = f"GPU(s) {listed} take layers 0-{a - 1}; {what}"
    options = lowering(s, _feasible(sizes, room), sizes.rewindable)
    raise StagePlanError(
        f"no split of the {n} layers over {len(room)} GPUs fits: filled in order, {what}; it "
        f"has {human(room[i])} ({free[i][1]}): "
        + (", or ".join(options) if options else "no setting makes it fit; add a GPU")
    )
