"""Op-by-op differential checking of the CUDA backend inside a real model run.

``OpCheck.backend`` builds the backend a device model calls: every op (``family.op``) runs through
the CUDA backend's family AND the torch backend's (on copies of its inputs, same device), and the
outputs, plus every tensor the op changes in place (KV pools, recurrent states), are compared.
The model goes on with the CUDA results, so a wrong kernel shows up as the first op whose result
differs, with its name and call number, instead of as wrong logits twenty layers later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mgserve.cuda.backend import Backend
from mgserve.cuda.pools import KVLayer


def _copy(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, KVLayer):
        return KVLayer(a.values.clone(), a.scales.clone())
    return a


def _tensors(a: Any) -> list[torch.Tensor]:
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, KVLayer):
        return [a.values, a.scales]
    if isinstance(a, tuple | list):
        return [t for x in a for t in _tensors(x)]
    return []


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float), 0 for empty tensors; inf on a shape mismatch."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


@dataclass
class Record:
    op: str
    call: int
    err: float
    what: str  # "out[0]", "arg 1 (in place)", ...


@dataclass
class _Family:
    """One family of the checked backend: its ops run on both families and are compared."""

    name: str
    cuda: Any
    torch_ops: Any
    check: OpCheck

    def __getattr__(self, name: str) -> Any:
        f_cuda = getattr(self.cuda, name)
        if not callable(f_cuda) or name.startswith("_"):
            return f_cuda
        f_torch = getattr(self.torch_ops, name)
        op = f"{self.name}.{name}"
        records, calls = self.check.records, self.check.calls

        def both(*args: Any, **kw: Any) -> Any:
            call = calls[op] = calls.get(op, 0) + 1
            t_args = [_copy(a) for a in args]
            t_kw = {k: _copy(v) for k, v in kw.items()}
            want = f_torch(*t_args, **t_kw)
            got = f_cuda(*args, **kw)
            for i, (g, w) in enumerate(zip(_tensors(got), _tensors(want), strict=False)):
                records.append(Record(op, call, rel_diff(g, w), f"out[{i}]"))
            for i, (a, ta) in enumerate(zip(args, t_args, strict=True)):
                for j, (g, w) in enumerate(zip(_tensors(a), _tensors(ta), strict=True)):
                    if (
                        not isinstance(a, torch.Tensor)
                        or a.is_floating_point()
                        or a.dtype == torch.int8
                    ):
                        records.append(Record(op, call, rel_diff(g, w), f"arg {i}.{j} (in place)"))
            return got

        return both


@dataclass
class OpCheck:
    records: list[Record] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)

    def backend(self, cuda: Backend, torch_ops: Backend) -> Backend:
        """``cuda`` with every family checked against the same family of ``torch_ops``."""
        families = {
            f.name: _Family(f.name, getattr(cuda, f.name), getattr(torch_ops, f.name), self)
            for f in dataclasses.fields(Backend)
            if f.name not in ("dense", "kernels")
        }
        return dataclasses.replace(cuda, **families)

    def worst(self, n: int = 10) -> list[Record]:
        return sorted(self.records, key=lambda r: -r.err)[:n]

    def first_above(self, tol: Callable[[str], float]) -> Record | None:
        for r in self.records:
            if r.err > tol(r.op):
                return r
        return None
