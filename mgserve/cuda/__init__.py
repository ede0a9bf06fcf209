"""Everything that touches a GPU (DESIGN.md: runtime, compiler, kernels, weights, pipeline, runner).

The CUDA backend is not built yet (issue 4); until then the reference path serves every model on the
CPU. ``resolve_device`` turns the ``--device`` setting into the backend that will run.
"""

from __future__ import annotations


def resolve_device(setting: str) -> str:
    """Return the backend for ``--device``: "cpu" today. "cuda" is refused with a clear message."""
    if setting == "cuda":
        raise ValueError(
            "--device cuda: the CUDA backend is not implemented yet; use --device cpu (or auto)"
        )
    if setting not in ("auto", "cpu"):
        raise ValueError(f"unknown device {setting!r}; expected auto, cpu or cuda")
    return "cpu"
