"""Record llama.cpp's logits on the tiny qwen3moe / qwen3next files for tests/core/test_qwen3*.py.

Run once (needs llama-cpp-python and transformers, CPU, ~20 s):
    python tests/data/make_hybrid_reference.py
Writes tests/data/hybrid_llama_reference.json, per architecture:
- ``gguf_sha256``: hash of the exported file, so a test notices if the export (HF init, exporter)
  changed and this data must be made again;
- ``tokens``: a 100-token random prompt followed by llama.cpp's 8 greedy continuation tokens;
- ``top5`` / ``top5_logits``: llama.cpp's 5 best tokens and their logits at every position
  (prompt evaluated in one batch with all logits, then one token per step);
- ``last_prompt_logits``, ``last_logits``: the full logit rows at the last prompt position and at
  the last generated one.
The llama.cpp context uses an F32 KV cache, so mgserve runs with an F32 cache to compare.
qwen3next is also run from a copy with fused ``ffn_gate_up_exps``, which must agree with the
separate-tensor file (checked here, not stored). ``qwen3next_synth`` is the same record for a
tiny quantized file in the real layout (hybrid_export.write_synth_qwen3next), 40 + 4 tokens.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.core.hybrid_export import (  # noqa: E402
    ARCHS,
    export,
    file_sha256,
    hf_model,
    prompt_tokens,
    write_synth_qwen3next,
)

OUT = ROOT / "tests" / "data" / "hybrid_llama_reference.json"
N_PROMPT = 100
N_GEN = 8
N_SYNTH = 40  # prompt tokens for the quantized synthetic file
GGML_TYPE_F32 = 0


def run(
    path: Path, prompt: list[int], n_gen: int = N_GEN, n_ctx: int = 256
) -> tuple[list[int], np.ndarray]:
    """llama.cpp's tokens (prompt + greedy continuation) and logits [len, V] at every position."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=2, seed=0,
        verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
    )  # fmt: skip
    llm.eval(prompt)
    tokens = list(prompt)
    for _ in range(n_gen):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(nxt)
        llm.eval([nxt])
    return tokens, np.array(llm.scores[: len(tokens)], dtype=np.float32)


def record(path: Path, tokens: list[int], logits: np.ndarray, n_prompt: int) -> dict:
    top5 = np.argsort(-logits, axis=1)[:, :5]
    return {
        "gguf_sha256": file_sha256(path),
        "n_prompt": n_prompt,
        "tokens": tokens,
        "top5": top5.tolist(),
        "top5_logits": np.round(np.take_along_axis(logits, top5, 1), 6).tolist(),
        "last_prompt_logits": np.round(logits[n_prompt - 1], 6).tolist(),
        "last_logits": np.round(logits[-1], 6).tolist(),
    }


def main() -> None:
    data: dict[str, dict] = {}
    prompt = prompt_tokens(N_PROMPT).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        synth = write_synth_qwen3next(Path(tmp) / "synth.gguf")
        synth_prompt = prompt[:N_SYNTH]
        tokens, logits = run(synth, synth_prompt, n_gen=4)
        data["qwen3next_synth"] = record(synth, tokens, logits, N_SYNTH)
        print(f"qwen3next_synth: continuation {tokens[N_SYNTH:]}")
        for arch in ARCHS:
            model = hf_model(arch)
            path = export(model, arch, Path(tmp) / f"{arch}.gguf")
            tokens, logits = run(path, prompt)
            if arch == "qwen3next":
                fused = export(model, arch, Path(tmp) / f"{arch}-fused.gguf", fused=True)
                _, logits_fused = run(fused, prompt)
                diff = float(np.abs(logits_fused - logits).max())
                assert diff < 1e-4, f"fused gate_up file disagrees by {diff}"
                print(f"{arch}: fused ffn_gate_up_exps vs separate: max |diff| {diff:.2e}")
            data[arch] = record(path, tokens, logits, N_PROMPT)
            print(f"{arch}: {len(tokens)} positions, continuation {tokens[N_PROMPT:]}")
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
