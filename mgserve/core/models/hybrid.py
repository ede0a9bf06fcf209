"""``load_hybrid``: a qwen3moe / qwen3next / qwen4exp GGUF file -> its reference model (see
models/__init__.py for the dense architectures)."""

from __future__ import annotations

from pathlib import Path

from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models.decoder import MoeLM
from mgserve.core.models.qwen3moe import Qwen3Moe
from mgserve.core.models.qwen3next import Qwen3Next
from mgserve.core.models.qwen4exp import Qwen4Exp

HYBRID_MODELS: dict[str, type[MoeLM]] = {
    "qwen3moe": Qwen3Moe,
    "qwen3next": Qwen3Next,
    "qwen4exp": Qwen4Exp,
}


def load_hybrid(path_or_file: str | Path | GGUFFile) -> MoeLM:
    """The reference model of a qwen3moe / qwen3next / qwen4exp file; GGUFError on a bad file."""
    g = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    spec, hybrid = hybrid_spec_from_gguf(g)
    return HYBRID_MODELS[spec.arch](g, spec, hybrid)
