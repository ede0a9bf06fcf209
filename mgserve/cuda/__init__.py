"""Everything that touches a GPU (DESIGN.md: runtime, compiler, kernels, weights, pools, models,
runner, graphs). Importing this package needs neither a GPU nor cuda-python; the modules that do
import cuda.core lazily.

``resolve_device`` turns the ``--device`` setting into the backend that will run.
"""

from __future__ import annotations


def cuda_available() -> str | None:
    """None when a CUDA GPU and cuda.core are usable here, else why not."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.core) is not installed"
    return None


def resolve_device(setting: str) -> str:
    """The backend for ``--device`` auto | cpu | cuda: "cpu" or "cuda". ValueError when cuda is
    asked for and cannot run here (with the reason)."""
    if setting not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {setting!r}; expected auto, cpu or cuda")
    if setting == "cpu":
        return "cpu"
    why = cuda_available()
    if why is None:
        return "cuda"
    if setting == "cuda":
        raise ValueError(f"--device cuda: {why}; use --device cpu (or auto)")
    return "cpu"
