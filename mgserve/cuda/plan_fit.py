"""The memory plan against the device: the table ``mgserve info --plan`` prints and ``serve`` logs,
and the check that refuses, before anything is allocated, a plan the GPU cannot hold, naming what
to lower and to what (``--ctx-size``, ``--parallel``, the cache types, ``--ctx-checkpoints``,
``--batch-size``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mgserve.config import Settings
from mgserve.core.gguf.reader import GGUFFile
from mgserve.cuda.plan import Item, ModelSizes, device_total, human, plan
from mgserve.cuda.plan_sizes import Part
from mgserve.settings_checks import GPU_BATCHES, with_batch
from mgserve.sizes import parse_sizes

CTX_STEP = 256  # a suggested --ctx-size is a multiple of this
FIXED = ("weights", "output head", "token embedding")  # items no serve setting changes


class PlanError(ValueError):
    """The plan needs more device memory than there is."""


def free_memory(settings: Settings, device: int = 0, index: int = 0) -> tuple[int | None, str]:
    """(bytes the plan may use on GPU ``device``, where that number comes from): ``--gpu-memory``
    (its ``index``-th size when it gives one per GPU), else what the GPU reports free (after the
    CUDA context), else (None, why not)."""
    if settings.gpu_memory is not None:
        sizes = parse_sizes(settings.gpu_memory, "gpu-memory")
        text = settings.gpu_memory.split(",")[index if len(sizes) > 1 else 0].strip()
        return sizes[index if len(sizes) > 1 else 0], f"--gpu-memory {text}"
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU here: give --gpu-memory to check the fit"
    free, _ = torch.cuda.mem_get_info(device)
    return free, f"free on {torch.cuda.get_device_name(device)}"


def render(sizes: ModelSizes, settings: Settings, items: list[Item], free: int | None,
           source: str) -> str:  # fmt: skip
    """The plan as a table: one line per item, GPU and host columns, totals, the verdict."""
    s = settings
    lines = [
        f"memory plan: {sizes.spec.arch}, {s.parallel} slot(s) x {s.ctx_size:,} tokens, "
        f"K {s.cache_type_k} / V {s.cache_type_v}, batch {with_batch(s, gpu=True).batch_size}",
        f"  {'item':<20} {'GPU':>11} {'host':>11}  detail",
    ]
    for it in items:
        gpu, host = ("", human(it.nbytes)) if it.host else (human(it.nbytes), "")
        lines.append(f"  {it.name:<20} {gpu:>11} {host:>11}  {it.detail}")
    total = device_total(items)
    host_total = sum(i.nbytes for i in items if i.host)
    lines.append(f"  {'total':<20} {human(total):>11} {human(host_total):>11}")
    if free is None:
        lines.append(f"  {'free':<20} {'?':>11}              {source}")
    else:
        verdict = f"fits, {human(free - total)} to spare" if total <= free else "does NOT fit"
        lines.append(f"  {'free':<20} {human(free):>11}              {source}: {verdict}")
    return "\n".join(lines)


def check(sizes: ModelSizes, settings: Settings, free: int, source: str,
          part: Part | None = None) -> None:  # fmt: skip
    """PlanError naming what to lower (and to what) unless the plan (of ``part``'s layers, or
    the whole model) fits in ``free`` bytes."""
    items = plan(sizes, settings, part)
    total = device_total(items)
    if total <= free:
        return
    fixed = sum(i.nbytes for i in items if i.name in FIXED)
    head = f"the memory plan needs {human(total)} of GPU memory; {human(free)} ({source})"
    if fixed > free:
        raise PlanError(f"{head}: the weights alone need {human(fixed)}; use a smaller quant")
    largest = max((i for i in items if not i.host and i.name not in FIXED), key=lambda i: i.nbytes)
    if largest.name == "KV cache":
        what = f"KV for {settings.parallel} slots x {settings.ctx_size} (and the spare slot) needs"
    else:
        what = f"{largest.name} ({largest.detail}) needs"
    options = lowering(settings, _fits(sizes, free, part), sizes.rewindable)
    raise PlanError(
        f"{head}: {what} {human(largest.nbytes)}; {human(free - fixed)} free after weights: "
        + (", or ".join(options) if options else "no setting makes it fit; use a smaller quant")
    )


def _fits(sizes: ModelSizes, free: int, part: Part | None = None) -> Callable[[Settings], bool]:
    return lambda s: device_total(plan(sizes, s, part)) <= free


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest n in [lo, hi] with ok(n), ok being monotone (True then False); None if none."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _round(ctx: int) -> int:
    return ctx // CTX_STEP * CTX_STEP if ctx >= CTX_STEP else ctx


def lowering(s: Settings, fits: Callable[[Settings], bool], rewindable: bool) -> list[str]:
    """What would make ``s`` fit (``fits``: whether settings do), each change alone."""
    s = with_batch(s, gpu=True)  # (an automatic --batch-size as plan() counts it)

    def new(**kw: object) -> Settings:
        return dataclasses.replace(s, **kw)  # type: ignore[arg-type]

    out = []
    ctx = _largest(1, s.ctx_size, lambda c: fits(new(ctx_size=c)))
    if ctx is not None:
        out.append(f"lower --ctx-size to {_round(ctx)}")
    par = _largest(1, s.parallel, lambda p: fits(new(parallel=p)))
    if par is not None:
        out.append(f"--parallel to {par}")
    if (s.cache_type_k, s.cache_type_v) != ("q8_0", "q8_0"):
        q8 = new(cache_type_k="q8_0", cache_type_v="q8_0")
        if fits(q8):
            out.append("use --cache-type-k q8_0 --cache-type-v q8_0")
        elif c := _largest(1, s.ctx_size, lambda c: fits(dataclasses.replace(q8, ctx_size=c))):
            out.append(f"use --cache-type-k/-v q8_0 with --ctx-size {_round(c)}")
    if not rewindable and s.ctx_checkpoints:
        n = _largest(0, s.ctx_checkpoints, lambda n: fits(new(ctx_checkpoints=n)))
        if n is not None:
            out.append(f"lower --ctx-checkpoints to {n}")
    batch = _largest(1, s.batch_size, lambda b: fits(new(batch_size=b)))
    if batch is not None:
        out.append(f"lower --batch-size to {batch}")
    return out


def summary(g: GGUFFile, settings: Settings) -> str:
    """What a session costs (K/V per token, recurrent state per slot) and the slots together."""
    sizes = ModelSizes.of(g)
    s, rec = settings, sizes.recurrent
    tk, tv = s.cache_type_k, s.cache_type_v
    session = sizes.kv(s.ctx_size, tk, tv) + sizes.blocks(s.ctx_size) + rec
    return "\n".join([
        f"KV cache (K {tk}, V {tv}): {sizes.kv(1, tk, tv):,} bytes per token"
        + (f"; recurrent state {rec:,} bytes per slot" if rec else ""),
        f"{s.ctx_size:,} tokens x {s.parallel} slot(s) = {session * s.parallel:,} bytes "
        f"({human(session * s.parallel)}); the whole GPU plan: mgserve info --plan",
    ])  # fmt: skip


def gpu_batch(g: GGUFFile, settings: Settings) -> Settings:
    """``settings`` (resolved for the model) with an automatic ``--batch-size`` (0) made
    concrete for one GPU: the first of GPU_BATCHES that the plan holds in the free memory
    (``free_memory``); the last where none does (the check then names what else to lower), the
    first where the free memory is unknown."""
    if settings.batch_size:
        return settings
    free, _ = free_memory(settings)
    if free is None:
        return with_batch(settings, gpu=True)
    fits = _fits(ModelSizes.of(g), free)
    batch = next((b for b in GPU_BATCHES if fits(dataclasses.replace(settings, batch_size=b))),
                 GPU_BATCHES[-1])  # fmt: skip
    return dataclasses.replace(settings, batch_size=batch)


def checked_plan(g: GGUFFile, settings: Settings, part: Part | None = None) -> str:
    """The plan of serving ``g`` with ``settings`` (resolved for the model) on GPU 0, as a table;
    PlanError (after the table, in its message) when it does not fit. ``part``: only a stage's
    layers (a process of a pipeline across processes loads only its own)."""
    sizes = ModelSizes.of(g)
    free, source = free_memory(settings)
    table = render(sizes, settings, plan(sizes, settings, part), free, source)
    if free is not None:
        try:
            check(sizes, settings, free, source, part)
        except PlanError as e:
            raise PlanError(f"{e}\n{table}") from None
    return table
