"""Record the tensor types ``llama-quantize ... Q4_K_M`` gives our synthetic models, for
tests/core/test_synth_mixes.py (the ``q4_k_m`` mix of mgserve/core/synth/mixes.py must match).

Run once (needs llama-cpp-python 0.3.36 built from the sdist and installed with ``pip install
--target $LLAMA_CPP_TARGET``, default /tmp/llcpp; CPU, a few minutes on 2 cores):
    python tests/data/make_q4_k_m_types.py
For each of ``CONFIGS`` it writes the shape with ``mgserve synth``'s writer in the ``bf16`` mix
(what llama.cpp's converter writes for a BF16 conversion), quantizes it with
``llama_cpp.llama_model_quantize`` (ftype LLAMA_FTYPE_MOSTLY_Q4_K_M, default parameters) and reads
the output's tensor types with gguf-py. Row widths (``ne0``, which decides the K-quant fallbacks)
are the real ones; only layer, expert, PLE-row and vocabulary counts are shrunk.

tests/data/q4_k_m_types.json: ``llama_cpp_version`` and, per config name, ``config`` (the
arguments of ``config_spec``) and ``types``: name pattern -> type, where a pattern is a tensor
name or ``blk.<layers>.<rest>`` with ``<layers>`` a comma-separated list of the layers whose
tensor ``blk.N.<rest>`` got that type.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mgserve.core.synth.shapes import SHAPES, ShapeSpec  # noqa: E402
from mgserve.core.synth.vocab import SynthVocab  # noqa: E402

OUT = ROOT / "tests" / "data" / "q4_k_m_types.json"
TARGET = Path(os.environ.get("LLAMA_CPP_TARGET", "/tmp/llcpp"))
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
N_VOCAB = 512  # token_embd/output rows only: their row width is n_embd either way

# name -> (shape, layers, experts); 8 experts takes llama.cpp's 8-expert branch, 1 its
# layer-counter fallback for ffn_down
CONFIGS: dict[str, dict] = {
    "qwen4exp": {"shape": "qwen4exp-flash-next", "layers": 8, "experts": 2},
    "qwen4exp-1-expert": {"shape": "qwen4exp-flash-next", "layers": 8, "experts": 1},
    "qwen3next": {"shape": "qwen3next-80b-a3b", "layers": 16, "experts": 2},
    "qwen3next-8-experts": {"shape": "qwen3next-80b-a3b", "layers": 8, "experts": 8},
    "qwen3next-1-expert": {"shape": "qwen3next-80b-a3b", "layers": 8, "experts": 1},
}


def config_spec(shape: str, layers: int, experts: int) -> ShapeSpec:
    """The full-width ``shape`` with ``layers`` layers, ``experts`` experts, a 4096-row PLE table
    (where it has one) and a ``N_VOCAB``-token vocabulary."""
    base = SHAPES[shape]
    ple_rows = 4096 if base.ple_layer is not None else None
    spec = base.shrink(layers=layers, experts=experts, ple_rows=ple_rows)
    vocab = SynthVocab(N_VOCAB, base.vocab.pre, 400, 401, 402, base.vocab.template)
    return dataclasses.replace(spec, vocab=vocab)


def patterns(types: dict[str, str]) -> dict[str, str]:
    """tensor name -> type, with the per-layer names folded into ``blk.<layers>.<rest>``."""
    layers: dict[tuple[str, str], list[int]] = defaultdict(list)
    out: dict[str, str] = {}
    for name, t in types.items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m:
            layers[(m.group(2), t)].append(int(m.group(1)))
        else:
            out[name] = t
    for (rest, t), ils in sorted(layers.items()):
        out[f"blk.{','.join(map(str, sorted(ils)))}.{rest}"] = t
    return out


def quantized_types(spec: ShapeSpec, tmp: Path) -> dict[str, str]:
    import llama_cpp
    from gguf import GGUFReader

    from mgserve.core.synth.write import write_synth

    src, dst = tmp / "bf16.gguf", tmp / "q4_k_m.gguf"
    write_synth(spec, src, seed=1, mix="bf16")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    types = {t.name: t.tensor_type.name for t in GGUFReader(dst).tensors}
    src.unlink()
    dst.unlink()
    return types


def main() -> None:
    sys.path.insert(0, str(TARGET))
    import llama_cpp

    data: dict = {"llama_cpp_version": llama_cpp.__version__, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            types = quantized_types(config_spec(**config), Path(tmp))
            data["configs"][name] = {"config": config, "types": patterns(types)}
            print(name, f"{len(types)} tensors", flush=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
