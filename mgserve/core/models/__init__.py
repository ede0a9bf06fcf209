"""Model definitions per architecture, and ``load_model`` (GGUF file -> ``CausalLM``)."""

from __future__ import annotations

from pathlib import Path

import torch

from mgserve.core.gguf.hparams import spec_from_gguf
from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.models.base import CausalLM, SeqInput
from mgserve.core.models.gemma3 import Gemma3
from mgserve.core.models.hybrid import HYBRID_MODELS, load_hybrid
from mgserve.core.models.llama import Llama
from mgserve.machine import available_cpus

__all__ = ["ARCHITECTURES", "CausalLM", "SeqInput", "load_model"]

# general.architecture -> reference implementation
ARCHITECTURES: dict[str, type[Llama]] = {
    "llama": Llama,
    "qwen2": Llama,
    "qwen3": Llama,
    "gemma3": Gemma3,
}


def set_threads(threads: int) -> None:
    """Torch's intra-op threads for the reference path (0: the cores this process may use, its
    affinity mask and cgroup quota: ``machine.available_cpus``). Process-wide."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    torch.set_num_threads(threads or available_cpus())


def load_model(path_or_file: str | Path | GGUFFile, *, threads: int = 0) -> CausalLM:
    """Open (if needed) a GGUF file and build its reference model; GGUFError on a bad file."""
    g = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    supported = (*ARCHITECTURES, *HYBRID_MODELS)
    if g.architecture not in supported:
        raise GGUFError(
            f"{g.path}: architecture {g.architecture!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )
    set_threads(threads)
    if g.architecture in HYBRID_MODELS:  # qwen3moe, qwen3next (MoE, Gated DeltaNet)
        return load_hybrid(g)
    spec = spec_from_gguf(g)
    return ARCHITECTURES[spec.arch](g, spec)
