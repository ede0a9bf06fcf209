"""``mgserve info FILE.gguf``: what a GGUF file holds and the memory sessions of a context need."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import Any, NamedTuple

from mgserve.config import Settings
from mgserve.core.gguf.hparams import ModelSpec, spec_from_gguf
from mgserve.core.gguf.hparams_hybrid import HYBRID_ARCHS, hybrid_spec_from_gguf
from mgserve.core.gguf.hparams_qwen4exp import qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.kvcache import kv_bytes_per_token
from mgserve.core.models.state import HybridState
from mgserve.core.models.state_qwen4exp import Qwen4ExpState

_MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / _MIB:,.1f} MiB"


class Memory(NamedTuple):
    """What one session costs beyond the weights."""

    per_token: int  # bytes per token of context: K/V (and QSA block keys)
    per_slot: int  # bytes per slot whatever the context: recurrent (DeltaNet, conv, PLE) state


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


def _hyperparameters(g: GGUFFile, type_k: str, type_v: str) -> tuple[ModelSpec, list[str], Memory]:
    """The architecture's hyperparameter records, printed, and its per-session memory."""
    if g.architecture not in HYBRID_ARCHS:
        spec = spec_from_gguf(g)
        lines = ["hyperparameters:", *_fields(spec, ("arch", "name"))]
        return spec, lines, Memory(kv_bytes_per_token(spec, type_k, type_v), 0)
    spec, hp = hybrid_spec_from_gguf(g)
    lines = [
        "hyperparameters:",
        *_fields(spec, ("arch", "name")),
        "  -- MoE / DeltaNet",
        *_fields(hp),
    ]

    def state(n_ctx: int) -> HybridState:
        if spec.arch == "qwen4exp":
            return Qwen4ExpState(spec, hp, qp, n_ctx, type_k, type_v)
        return HybridState(spec, hp, n_ctx, type_k, type_v)

    if spec.arch == "qwen4exp":
        qp = qwen4exp_spec_from_gguf(g, hp.recurrent, spec.n_rot)
        lines += ["  -- hyper-connections, QSA, PLE", *_fields(qp)]
    # the state classes are the source of truth: measure two small ones (64 tokens is a whole
    # number of QSA blocks) rather than repeat their byte accounting here
    small, large = state(64).nbytes, state(128).nbytes
    per_token = (large - small) // 64
    return spec, lines, Memory(per_token, small - 64 * per_token)


def describe(g: GGUFFile, settings: Settings) -> str:
    """What ``g`` holds and what ``settings.parallel`` sessions of its context need (ctx_size 0:
    the model's, resolved as the server resolves it: ``Settings.for_model``)."""
    type_k, type_v = settings.cache_type_k, settings.cache_type_v
    spec, hyper, mem = _hyperparameters(g, type_k, type_v)
    n_ctx, n_slots = settings.for_model(spec.n_ctx_train).ctx_size, settings.parallel
    lines = [
        f"file:          {g.path} ({_mib(g.path.stat().st_size)})",
        f"architecture:  {spec.arch}",
        f"name:          {spec.name}",
        *hyper,
    ]
    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    for t in g:
        counts[t.type_name] += 1
        sizes[t.type_name] += t.n_bytes
    total = sum(sizes.values())
    lines += ["tensors:", f"  {'type':<8} {'count':>6} {'bytes':>17} {'size':>14}"]
    for name in sorted(sizes, key=lambda k: -sizes[k]):
        lines.append(f"  {name:<8} {counts[name]:>6} {sizes[name]:>17,} {_mib(sizes[name]):>14}")
    lines.append(f"  {'total':<8} {sum(counts.values()):>6} {total:>17,} {_mib(total):>14}")

    session = mem.per_token * n_ctx + mem.per_slot
    lines.append(
        f"KV cache (K {type_k}, V {type_v}): {mem.per_token:,} bytes per token"
        + (f"; recurrent state {mem.per_slot:,} bytes per slot" if mem.per_slot else "")
    )
    lines += [
        f"{n_ctx:,} tokens x {n_slots} slot(s) = {session * n_slots:,} bytes "
        f"({_mib(session * n_slots)})",
        f"weights + sessions: {_mib(total + session * n_slots)}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    s = Settings(  # the server's checks of these settings, and its defaults
        ctx_size=args.ctx_size or 0,
        parallel=args.parallel,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
    )
    g = GGUFFile(args.file)
    print(describe(g, s))
    return 0
