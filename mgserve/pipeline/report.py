"""The stage plan as ``mgserve info --plan`` prints it when the settings name several GPUs
(``--device-list``, or a ``--gpu-memory`` size per GPU): one row per stage (its GPU, layers,
weights, K/V and state, buffers, total against its free memory, its balance load), then where
the model's ends live and what crosses each link."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mgserve.config import Settings, settings_from
from mgserve.core.gguf.reader import GGUFFile
from mgserve.cuda.plan import human
from mgserve.cuda.plan_fit import free_memory
from mgserve.devices import parse_split, stage_devices
from mgserve.pipeline.costs import ModelCosts
from mgserve.pipeline.stages import StagePlan, StagePlanError, fitted_plan
from mgserve.settings_checks import with_batch

WEIGHTS = ("weights", "output head", "token embedding")
STATE = ("KV cache", "QSA block keys", "recurrent state", "device checkpoints")


def visible_gpus() -> int | None:
    """How many GPUs CUDA shows this process (CUDA_VISIBLE_DEVICES applied); None: none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def devices_of(settings: Settings) -> tuple[int, ...]:
    """The CUDA ordinals of the stages ``settings`` ask for (one: no pipeline)."""
    visible = visible_gpus() if settings.device_list is not None else None
    return stage_devices(settings.device_list, settings.gpu_memory, visible)


def stage_free(settings: Settings, devices: Sequence[int]) -> list[tuple[int, str]]:
    """(bytes, where from) each stage's GPU may use: ``--gpu-memory``, else what it has free."""
    out = []
    for i, dev in enumerate(devices):
        free, source = free_memory(settings, dev, i)
        if free is None:
            raise StagePlanError(
                "no GPU here: give --gpu-memory (one size, or one per GPU) to plan the stages"
            )
        out.append((free, source))
    return out


def _sum(items: Sequence[object], names: Sequence[str]) -> int:
    return sum(i.nbytes for i in items if i.name in names and not i.host)  # type: ignore[attr-defined]


def render(p: StagePlan) -> str:
    s, stages = p.settings, p.stages
    peak = max(st.load for st in stages) or 1.0
    lines = [
        f"stage plan: {p.arch}, {len(stages)} GPUs, {s.parallel} slot(s) x {s.ctx_size:,} "
        f"tokens, K {s.cache_type_k} / V {s.cache_type_v}, "
        f"batch {with_batch(s, gpu=True).batch_size}; {p.how}",
        f"  {'stage':>5} {'GPU':>4}  {'layers':<8} {'weights':>10} {'KV + state':>11} "
        f"{'buffers':>10} {'total':>10} {'free':>10}  load",
    ]
    for st in stages:
        w, kv = _sum(st.items, WEIGHTS), _sum(st.items, STATE)
        work = _sum(st.items, ("workspace",))
        layers = f"{st.part.start}-{st.part.stop - 1}"
        lines.append(
            f"  {st.index:>5} {st.device:>4}  {layers:<8} {human(w):>10} {human(kv):>11} "
            f"{human(work):>10} {human(st.total):>10} {human(st.free):>10}  "
            f"{100 * st.load / peak:.0f}%"
        )
    first, last = stages[0], stages[-1]
    lines.append(
        f"  token embedding on GPU {first.device}, output head and sampler on GPU {last.device}; "
        "load: the stage's share of the busiest one's"
    )
    host = [i for st in stages for i in st.items if i.host]
    for st in stages:
        for it in st.items:
            if it.name == "PLE table":
                lines.append(
                    f"  PLE table: {human(it.nbytes)} in host memory ({it.detail}); the host "
                    f"gathers each token's rows for layer {p.ple_layer} on GPU {st.device}"
                )
    ckpt = sum(i.nbytes for i in host if i.name == "host checkpoints")
    if ckpt:
        lines.append(f"  host checkpoints (pinned, all stages): {human(ckpt)}")
    lines.append(
        f"  per token: {p.handoff_bytes:,} bytes over each link between stages (the residual "
        f"and a position), {p.host_bytes:,} bytes from the host to GPU {first.device}"
    )
    return "\n".join(lines)


def plan_for(g: GGUFFile, settings: Settings) -> StagePlan:
    """The stage plan of serving ``g`` with ``settings`` (resolved for the model) over the GPUs
    they name; StagePlanError when it does not fit."""
    devices = devices_of(settings)
    costs = ModelCosts.of(g, settings.cache_type_k, settings.cache_type_v)
    split = parse_split(settings.tensor_split) if settings.tensor_split else None
    return fitted_plan(costs, settings, devices, stage_free(settings, devices), split)


def info_main(args: argparse.Namespace) -> int:
    """``mgserve info``: with ``--plan`` and several GPUs, the file's description and its stage
    plan; otherwise what ``mgserve.core.gguf.info`` prints (the one-GPU plan)."""
    from mgserve.core.builtin_models import resolve_model
    from mgserve.core.gguf.info import describe, main, model_spec

    s = settings_from(args, **({"model": args.file} if args.file else {}))
    if not args.plan or len(devices_of(s)) < 2:
        return main(args)
    g = GGUFFile(resolve_model(s.model, s.cache_dir))
    s = s.for_model(model_spec(g).n_ctx_train)
    text = describe(g, s, with_plan=False)
    print(f"{text}\n{render(plan_for(g, s))}")
    return 0
