"""Sizes as users write them (``24GiB``, ``80GB``, ``20000`` MiB), in bytes: ``--gpu-memory``, one
size or one per GPU."""

from __future__ import annotations

import re

_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
          "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40,
          "tib": 1 << 40, "tb": 10**12}  # fmt: skip


def parse_size(text: str, name: str) -> int:
    """Bytes of a size such as ``24GiB``, ``24G`` (binary), ``80GB`` (decimal) or ``20000``
    (MiB); ValueError naming the setting ``name`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or not unit or float(m.group(1)) <= 0:
        raise ValueError(
            f"{name} must be a positive size such as 24GiB, 80GB or 20000 (MiB), got {text!r}"
        )
    return int(float(m.group(1)) * unit)


def parse_sizes(text: str, name: str) -> list[int]:
    """Bytes of a comma-separated list of sizes (``24GiB,24GiB,16GiB``): one per GPU."""
    return [parse_size(part, name) for part in text.split(",")]
