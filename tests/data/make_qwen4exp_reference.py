"""Record llama.cpp's logits on two tiny qwen4exp files for tests/core/test_qwen4exp.py.

Run once (needs llama-cpp-python and transformers, CPU, ~90 s):
    python tests/data/make_qwen4exp_reference.py
Writes tests/data/qwen4exp_llama_reference.json with, per file, the fields of
make_hybrid_reference.py's records (``gguf_sha256``, ``n_prompt``, ``tokens``, ``top5``,
``top5_logits``, ``last_prompt_logits``, ``last_logits``): a 300-token prompt (an EOS every 37
tokens resets PLE's n-grams) and 8 greedy tokens, F32 KV cache.

- ``r4``: the issue's config (blocks of 4, 2 indexer heads, budget 64: QSA selects 16 of up to
  75 blocks). llama.cpp's QSA differs from the reference by design (src/models/qwen4exp.cpp, marked
  "pending complete reimplementation"): it ranks cells, not blocks, and keeps ``top_k + r - 1``
  of them, so a query whose tail is shorter than r - 1 also attends up to 3 cells of its 17th-best
  block (which ones: std::partial_sort's tie order), and equal block scores (all heads' relu at 0,
  common with 2 heads) are broken differently. It agrees with transformers to ~1e-5 while QSA is
  dense (positions < 67) and drifts by a few percent after.
- ``r1``: blocks of 1 token and 8 indexer heads: cell and block ranking coincide and zero-score
  ties are rare, so llama.cpp must agree with transformers (and mgserve) at every position while
  QSA selects 64 of up to 307 tokens.
- ``synth``: a tiny file in the real layout and quant mix (qwen4exp_export.write_synth_qwen4exp),
  100 + 4 tokens (QSA selects from position 67 on).
The script prints llama.cpp's distance to transformers itself for the first two.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.core.hybrid_export import hf_logits  # noqa: E402
from tests.core.qwen4exp_export import (  # noqa: E402
    export,
    hf_model,
    prompt_tokens,
    write_synth_qwen4exp,
)
from tests.data.make_hybrid_reference import record, run  # noqa: E402

OUT = ROOT / "tests" / "data" / "qwen4exp_llama_reference.json"
N_PROMPT = 300
EOS_EVERY = 37
N_SYNTH = 100
VARIANTS = {"r4": {}, "r1": {"indexer_compress_ratio": 1, "indexer_n_heads": 8}}


def main() -> None:
    prompt = prompt_tokens(N_PROMPT, eos_every=EOS_EVERY).tolist()
    data = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, changes in VARIANTS.items():
            model = hf_model(**changes)
            path = export(model, Path(tmp) / f"qwen4exp-{name}.gguf")
            tokens, logits = run(path, prompt, n_ctx=512)
            data[name] = record(path, tokens, logits, N_PROMPT)
            hf = hf_logits(model, torch.tensor(tokens), N_PROMPT).numpy()
            diff = np.abs(logits - hf).max(axis=1) / np.abs(hf).max()
            agree = (logits.argmax(1) == hf.argmax(1)).mean()
            print(
                f"{name}: llama.cpp vs transformers: max rel {diff.max():.2e}, "
                f"median {np.median(diff):.2e}, before position 67 {diff[:67].max():.2e}, "
                f"top-1 agreement {agree:.3f}; continuation {tokens[N_PROMPT:]}"
            )
        synth = write_synth_qwen4exp(Path(tmp) / "synth.gguf")
        tokens, logits = run(synth, prompt[:N_SYNTH], n_gen=4, n_ctx=512)
        data["synth"] = record(synth, tokens, logits, N_SYNTH)
        print(f"synth: continuation {tokens[N_SYNTH:]}")
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
