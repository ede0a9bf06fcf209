"""``mgserve info FILE.gguf``: what a GGUF file holds and the KV memory a context would need."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

from mgserve.core.gguf import GGUFFile
from mgserve.core.kvcache import kv_bytes_per_token
from mgserve.core.spec import ModelSpec, spec_from_gguf

_MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / _MIB:,.1f} MiB"


def describe(
    g: GGUFFile, spec: ModelSpec, n_ctx: int, n_slots: int, type_k: str, type_v: str
) -> str:
    lines = [
        f"file:          {g.path} ({_mib(g.path.stat().st_size)})",
        f"architecture:  {spec.arch}",
        f"name:          {spec.name}",
        "hyperparameters:",
    ]
    for f in dataclasses.fields(spec):
        if f.name in ("arch", "name"):
            continue
        value = getattr(spec, f.name)
        if f.name == "swa_layers":
            global_layers = [il for il, swa in enumerate(value) if not swa]
            value = f"{sum(value)} sliding, global: {global_layers}" if any(value) else "none"
        lines.append(f"  {f.name:<15} {value}")

    counts: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = defaultdict(int)
    for t in g:
        counts[t.type_name] += 1
        sizes[t.type_name] += t.n_bytes
    total = sum(sizes.values())
    lines += ["tensors:", f"  {'type':<8} {'count':>6} {'bytes':>15} {'size':>14}"]
    for name in sorted(sizes, key=lambda k: -sizes[k]):
        lines.append(f"  {name:<8} {counts[name]:>6} {sizes[name]:>15,} {_mib(sizes[name]):>14}")
    lines.append(f"  {'total':<8} {sum(counts.values()):>6} {total:>15,} {_mib(total):>14}")

    per_token = kv_bytes_per_token(spec, type_k, type_v)
    kv_total = per_token * n_ctx * n_slots
    lines += [
        f"KV cache (K {type_k}, V {type_v}): {per_token:,} bytes per token; "
        f"{n_ctx:,} tokens x {n_slots} slot(s) = {kv_total:,} bytes ({_mib(kv_total)})",
        f"weights + KV: {_mib(total + kv_total)}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    g = GGUFFile(args.file)
    spec = spec_from_gguf(g)
    n_ctx = args.ctx_size or spec.n_ctx_train
    if n_ctx < 0:
        raise ValueError(f"ctx-size must be >= 0, got {n_ctx}")
    if args.parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {args.parallel}")
    print(describe(g, spec, n_ctx, args.parallel, args.cache_type_k, args.cache_type_v))
    return 0
