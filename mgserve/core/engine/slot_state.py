"""A slot's state copied out of a runner and back (slot save / restore), or into another slot (a
prefix copy): what both runners share.

Each runner names the tensors of a slot (``Part``s: K/V and QSA block keys, whose first axis is
positions, cut to a state of n tokens; the recurrent state and checkpoints whole). A save copies
them to host memory; a restore checks every tensor a file gives against the slot's (names, dtypes,
shapes) before it writes any, so a file that does not fit leaves the slot as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from mgserve.core.engine.contract import SlotTensors


class Part(NamedTuple):
    tensor: torch.Tensor  # the slot's tensor in the runner's memory
    per: int = 1  # its first axis holds one row per `per` positions; 0: the tensor is whole


def rows(part: Part, n: int) -> torch.Tensor:
    """The part of ``part`` that belongs to a state of ``n`` tokens (a view)."""
    return part.tensor if part.per == 0 else part.tensor[: n // part.per]


def copy_out(parts: Mapping[str, Part], n: int) -> dict[str, torch.Tensor]:
    return {name: rows(p, n).to("cpu", copy=True) for name, p in parts.items()}


def ckpt_name(pos: int, name: str) -> str:
    """A checkpoint's tensor among a slot's: ``ckpt.<position>.<name>``."""
    return f"ckpt.{pos}.{name}"


def check(tensors: SlotTensors, want: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """ValueError naming the first tensor that ``want`` (name -> dtype, shape) does not have."""
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(f"the saved state lacks {missing[0]!r}")
    for name, t in tensors.items():
        if name not in want:
            raise ValueError(f"the saved state has {name!r}, which this slot does not hold")
        dtype, shape = want[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{name!r} is {t.dtype} {tuple(t.shape)}, this slot holds {dtype} {shape}"
            )


def layout(parts: Mapping[str, Part], n: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (p.tensor.dtype, tuple(rows(p, n).shape)) for name, p in parts.items()}


def copy_in(parts: Mapping[str, Part], n: int, tensors: SlotTensors) -> None:
    for name, p in parts.items():
        rows(p, n).copy_(tensors[name])


def copy_rows(src: Mapping[str, Part], dst: Mapping[str, Part], n: int) -> None:
    """The rows of a state of ``n`` tokens from one slot's parts into another's (a prefix copy),
    where they live, on the current stream."""
    for name, p in dst.items():
        rows(p, n).copy_(rows(src[name], n))
