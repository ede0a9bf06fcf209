"""``mgserve info FILE.gguf``: what a GGUF file holds and the memory sessions of a context need."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import Any

from mgserve.config import Settings, settings_from
from mgserve.core.gguf.hparams import ModelSpec, spec_from_gguf
from mgserve.core.gguf.hparams_hybrid import HYBRID_ARCHS, hybrid_spec_from_gguf
from mgserve.core.gguf.hparams_qwen4exp import qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFFile

_MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / _MIB:,.1f} MiB"


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> list[str]:
    lines = []
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        if f.name == "swa_layers":
            global_layers = [il for il, swa in enumerate(value) if not swa]
            value = f"{sum(value)} sliding, global: {global_layers}" if any(value) else "none"
        elif f.name in ("recurrent", "compress"):  # per-layer tuples: say which layers
            value = f"layers {[il for il, v in enumerate(value) if v]}"
        lines.append(f"  {f.name:<22} {value}")
    return lines


def _hyperparameters(g: GGUFFile) -> list[str]:
    """The architecture's hyperparameter records, printed."""
    if g.architecture not in HYBRID_ARCHS:
        return ["hyperparameters:", *_fields(spec_from_gguf(g), ("arch", "name"))]
    spec, hp = hybrid_spec_from_gguf(g)
    lines = [
        "hyperparameters:",
        *_fields(spec, ("arch", "name")),
        "  -- MoE / DeltaNet",
        *_fields(hp),
    ]
    if spec.arch == "qwen4exp":
        qp = qwen4exp_spec_from_gguf(g, hp.recurrent, spec.n_rot)
        lines += ["  -- hyper-connections, QSA, PLE", *_fields(qp)]
    return lines


def model_spec(g: GGUFFile) -> ModelSpec:
    """The file's model hyperparameters (of the hybrid families too)."""
    return hybrid_spec_from_gguf(g)[0] if g.architecture in HYBRID_ARCHS else spec_from_gguf(g)


def describe(g: GGUFFile, settings: Settings, with_plan: bool = False) -> str:
    """What ``g`` holds and what ``settings.parallel`` sessions of its context need on the GPU
    (the memory plan's numbers, ``mgserve/cuda/plan.py``; ``with_plan``: its whole table, checked
    against the GPU's free memory or ``--gpu-memory``: ValueError when it does not fit)."""
    from mgserve.core.engine.factory import memory_plan

    spec = model_spec(g)
    lines = [
        f"file:          {g.path} ({_mib(g.path.stat().st_size)})",
        f"architecture:  {spec.arch}",
        f"name:          {spec.name}",
        *_hyperparameters(g),
    ]
    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    for t in g:
        counts[t.type_name] += 1
        sizes[t.type_name] += t.n_bytes
    total = sum(sizes.values())
    lines += ["tensors:", f"  {'type':<8} {'count':>6} {'bytes':>17} {'size':>14}"]
    for name in sorted(sizes, key=lambda k: -sizes[k]):
        n = sizes[name]
        lines.append(f"  {name:<8} {counts[name]:>6} {n:>17,} {_mib(n):>14}")
    lines.append(f"  {'total':<8} {sum(counts.values()):>6} {total:>17,} {_mib(total):>14}")
    return "\n".join([*lines, memory_plan(g, settings.for_model(spec.n_ctx_train), with_plan)])


def main(args: argparse.Namespace) -> int:
    """``args``: the serve settings' flags (and MGSERVE_* variables), the file in place of
    ``--model`` when given, and ``--plan``."""
    from mgserve.core.builtin_models import resolve_model

    s = settings_from(args, **({"model": args.file} if args.file else {}))
    g = GGUFFile(resolve_model(s.model, s.cache_dir))
    print(describe(g, s, with_plan=args.plan))
    return 0
