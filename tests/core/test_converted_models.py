"""mgserve on GGUF files written by llama.cpp's own converter, against llama.cpp's outputs on them.

tests/data/converted_{qwen4exp,qwen3next,llama}.gguf were made by
tests/data/make_converted_reference.py: tiny random transformers checkpoints through
``convert_hf_to_gguf.py``'s model classes (only the vocabulary is ours), then run by llama.cpp
(llama-cpp-python 0.3.36): a 60-token prompt, 8 greedy
tokens, top-5 logits at every position. Nothing of mgserve's own export layout is involved: the
qwen4exp file has 1-D hyper-connection / PLE norms, [n_embd, 1] shared-expert gates, a PLE table
joined from checkpoint shards; the qwen3next file has an MTP block appended as a 5th block
(``nextn_predict_layers = 1``) and per-layer ``recurrent_layers``; the llama file is a tiny
Mixtral, which the converter writes as architecture ``llama`` with experts.

Both sides read F32 weights and keep an F32 KV cache, so only float rounding order differs
(observed ~1e-6 relative); the reference path and the device backend (torch ops, CPU) must give
llama.cpp's greedy tokens and its logits to 1e-4 of their scale.

qwen4exp note: llama.cpp's converter writes ``attention.compress_ratios`` from HF ``layer_types``
entries equal to "full_attention"; transformers 5.23 calls those layers "indexed_attention", so the
converted file has ratio 0 everywhere and llama.cpp runs dense attention on them. mgserve reads
the same key and must do the same (the indexer tensors are loaded by neither).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model
from mgserve.cuda.models.base import Span, Step
from tests.core.hybrid_export import file_sha256, rel_error, run_chunks

DATA = Path(__file__).resolve().parents[1] / "data"
ARCHS = ("qwen4exp", "qwen3next", "llama")
N_LAYER = {"qwen4exp": 4, "qwen3next": 4, "llama": 2}
TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    return json.loads((DATA / "converted_llama_reference.json").read_text())


def _file(arch: str, refs: dict[str, Any]) -> Path:
    path = DATA / f"converted_{arch}.gguf"
    assert file_sha256(path) == refs[arch]["gguf_sha256"], "rerun make_converted_reference.py"
    return path


def _check(got: torch.Tensor, ref: dict[str, Any]) -> None:
    """``got`` [T, V]: logits at every position of ref's tokens (teacher-forced)."""
    n = ref["n_prompt"]
    top5, top5_logits = torch.tensor(ref["top5"]), torch.tensor(ref["top5_logits"])
    assert got.argmax(dim=1)[n - 1 : -1].tolist() == ref["tokens"][n:]  # the greedy tokens
    assert torch.equal(got.argmax(dim=1), top5[:, 0])
    assert rel_error(torch.gather(got, 1, top5), top5_logits) <= TOL
    assert rel_error(got[n - 1], torch.tensor(ref["last_prompt_logits"])) <= TOL
    assert rel_error(got[-1], torch.tensor(ref["last_logits"])) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_file_layout(arch: str, refs: dict[str, Any]) -> None:
    """The files really are in the converter's layout (what the other tests rely on)."""
    g = GGUFFile(_file(arch, refs))
    assert g.architecture == arch
    if arch == "llama":
        assert g.get("llama.expert_count") == 4 and g.get("llama.expert_used_count") == 2
        assert g.tensors["blk.1.ffn_gate_exps.weight"].shape == (64, 64, 4)
        assert "blk.0.ffn_gate.weight" not in g.tensors
        return
    assert g.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (64, 1)
    if arch == "qwen4exp":
        assert g.tensors["output_hc_norm.weight"].shape == (256,)
        assert g.tensors["blk.1.ple_norm_key.weight"].shape == (256,)
        assert g.get("tokenizer.ggml.pre") == "qwen35"
    else:
        assert g.get(f"{arch}.nextn_predict_layers") == 1 and g.get(f"{arch}.block_count") == 5
        assert "blk.4.nextn.eh_proj.weight" in g.tensors


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_path_matches_llama_cpp(arch: str, refs: dict[str, Any]) -> None:
    ref = refs[arch]
    lm = load_model(_file(arch, refs), threads=1)
    assert lm.spec.n_layer == N_LAYER[arch]  # qwen3next's MTP block is not part of the model
    toks, n = torch.tensor(ref["tokens"]), ref["n_prompt"]
    state = lm.new_cache(256, "f32", "f32")
    got = torch.cat([run_chunks(lm, state, toks[:n], 16), run_chunks(lm, state, toks[n:], 1, n)])
    _check(got, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_device_backend_matches_llama_cpp(arch: str, refs: dict[str, Any]) -> None:
    """The device model with the torch backend on the CPU: the prompt in one prefill step, then
    one decode step per token."""
    from mgserve.cuda.backend import load_device_model, torch_backend

    ref, cpu = refs[arch], torch.device("cpu")
    model = load_device_model(
        GGUFFile(_file(arch, refs)), torch_backend(), cpu, 1, 256, "f32", "f32"
    )
    toks, n = ref["tokens"], ref["n_prompt"]
    model.begin_sequence(0)

    def step(tokens: list[int], start: int, decode: bool) -> torch.Tensor:
        t = len(tokens)
        st = Step(
            torch.tensor(tokens),
            torch.arange(start, start + t, dtype=torch.int32),
            torch.zeros(t, dtype=torch.int32),
            decode=decode,
            spans=(Span(0, start, t),),
            logit_rows=None,
            extra=model.step_extra([tokens], [0]),
        )
        return model.forward(st).float()

    rows = [step(toks[:n], 0, False)]
    rows += [step([toks[i]], i, True) for i in range(n, len(toks))]
    _check(torch.cat(rows), ref)
