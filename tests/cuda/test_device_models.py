"""The device models against the reference models, on tiny files of every architecture.

Each case runs the same sessions through both: two prompts prefilled in one step (two spans, one
ending mid-QSA-block), a third prompt alone, then decode steps of all three sessions batched, and
compares every logit row. The torch backend runs on the CPU here (and in CI): it checks the device
models' logic (pools, slots, spans, decode without host data, weight reordering). The CUDA backend
(gpu-marked) runs the same cases with the kernels; its tolerance allows the f16 prefill GEMMs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.models import load_model
from mgserve.core.models.base import SeqInput
from mgserve.cuda.models.base import Span, Step

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen3next", "qwen4exp")
N_CTX = 160
PROMPTS = (37, 22, 70)  # qwen4exp: 70 tokens pass the QSA budget of 64 (16 blocks of 4)
N_DECODE = 4
TOL_TORCH = 1e-4  # max |diff| / max |logit|, float32 both sides (observed ~3e-5)
TOL_CUDA = 1e-2  # fp32 prefill; a near-tie MoE routing choice flipping moves logits ~7e-3


def _export(arch: str, root: Path) -> Path:
    """The tiny model of ``arch`` as a GGUF file in ``root`` (or the copy in MGSERVE_TEST_TINY:
    the GPU machine's transformers is not the version the exporters are written for)."""
    pre = os.environ.get("MGSERVE_TEST_TINY")
    if pre and (Path(pre) / f"{arch}.gguf").is_file():
        return Path(pre) / f"{arch}.gguf"
    path = root / f"{arch}.gguf"
    if arch in ("llama", "qwen2", "qwen3", "gemma3"):
        from tests.core import tiny

        return tiny.export(tiny.hf_model(arch), arch, path)
    if arch == "qwen4exp":
        from tests.core import qwen4exp_export

        return qwen4exp_export.export(qwen4exp_export.hf_model(), path)
    from tests.core import hybrid_export

    return hybrid_export.export(hybrid_export.hf_model(arch), arch, path)


def _tokens(n: int, seed: int, n_vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(n_vocab, 250), (n,), generator=g).tolist()


def _reference_run(
    path: Path, prompts: list[list[int]], decode: list[list[int]]
) -> list[torch.Tensor]:
    """Logits per step (rows in session order) of the reference model."""
    lm = load_model(path)
    caches = [lm.new_cache(N_CTX) for _ in prompts]
    out = []
    seqs = [SeqInput(caches[i], torch.tensor(prompts[i]), 0, 1) for i in (0, 1)]
    out.append(lm.forward(seqs))
    out.append(lm.forward([SeqInput(caches[2], torch.tensor(prompts[2]), 0, 1)]))
    pos = [len(p) for p in prompts]
    for step in decode:
        seqs = [SeqInput(caches[i], torch.tensor([step[i]]), pos[i], 1) for i in range(3)]
        out.append(lm.forward(seqs))
        pos = [p + 1 for p in pos]
    return out


def _device_run(model: Any, device: torch.device, prompts: list[list[int]], decode: list[list[int]],
                slots: tuple[int, ...]) -> list[torch.Tensor]:  # fmt: skip
    def step(spans: list[tuple[int, list[int], int]], is_decode: bool) -> torch.Tensor:
        tokens = [t for _, toks, _ in spans for t in toks]
        pos = [s + i for _, toks, s in spans for i in range(len(toks))]
        sl = [slot for slot, toks, _ in spans for _ in toks]
        ends = torch.tensor([len(t) for _, t, _ in spans]).cumsum(0) - 1
        st = Step(
            torch.tensor(tokens, device=device),
            torch.tensor(pos, dtype=torch.int32, device=device),
            torch.tensor(sl, dtype=torch.int32, device=device),
            decode=is_decode,
            spans=tuple(Span(slot, s, len(t)) for slot, t, s in spans),
            logit_rows=None if is_decode else ends.to(device),
            extra=model.step_extra([t for _, t, _ in spans], [slot for slot, _, _ in spans]),
        )
        if st.extra is not None:
            st.extra = st.extra.to(device)
        return model.forward(st).float().cpu()

    for s in slots:
        model.begin_sequence(s)
    out = [step([(slots[0], prompts[0], 0), (slots[1], prompts[1], 0)], False)]
    out.append(step([(slots[2], prompts[2], 0)], False))
    pos = [len(p) for p in prompts]
    for toks in decode:
        out.append(step([(slots[i], [toks[i]], pos[i]) for i in range(3)], True))
        pos = [p + 1 for p in pos]
    return out


def _compare(arch: str, path: Path, backend: Any, device: torch.device, tol: float) -> None:
    from mgserve.cuda.backend import load_device_model

    g = GGUFFile(path)
    model = load_device_model(g, backend, device, n_slots=4, n_ctx=N_CTX)
    n_vocab = model.spec.n_vocab
    prompts = [_tokens(n, seed, n_vocab) for seed, n in enumerate(PROMPTS)]
    decode = [_tokens(3, 100 + i, n_vocab) for i in range(N_DECODE)]
    want = _reference_run(path, prompts, decode)
    got = _device_run(model, device, prompts, decode, slots=(2, 0, 3))  # slots out of order
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < tol, f"{arch} step {i}: relative error {err:.2e} (tolerance {tol:.0e})"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("stable_qsa_ties")
def test_torch_backend_matches_reference(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    torch.manual_seed(0)
    _compare(arch, _export(arch, tmp_path), torch_backend(), torch.device("cpu"), TOL_TORCH)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.usefixtures("stable_qsa_ties")
def test_cuda_backend_matches_reference(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    from mgserve.cuda.backend import cuda_backend

    # f16 prefill GEMMs are checked op by op (opcheck test below): the tiny random hybrids
    # amplify their 1e-3 rounding into 1e-1 logit differences
    backend = cuda_backend(0, prefill_exact=True)
    _compare(arch, _export(arch, tmp_path), backend, torch.device("cuda", 0), TOL_CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ("qwen4exp", "qwen3next", "gemma3"))
@pytest.mark.usefixtures("stable_qsa_ties")
def test_cuda_backend_torch_ops_on_gpu(arch: str, tmp_path: Path) -> None:
    """The torch backend on the GPU: the fallback path itself is right on the device."""
    from mgserve.cuda.backend import torch_backend

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    _compare(arch, _export(arch, tmp_path), torch_backend(), torch.device("cuda", 0), TOL_CUDA)


OP_TOL = {  # the f16 prompt GEMMs (and the prompt-size HC mix and PLE gate, which run on them)
    "linear.matmul": 3e-3,
    "moe.experts": 3e-3,
    "hc.mix": 3e-3,
    "hc.combine_mix": 3e-3,
    "ple.gated": 3e-3,
    "attention.prefill": 5e-3,
    "qsa.prefill": 5e-3,
}


@pytest.mark.gpu
@pytest.mark.usefixtures("stable_qsa_ties")
@pytest.mark.parametrize("arch", ("qwen3next", "qwen4exp", "gemma3"))
def test_every_cuda_op_matches_torch_inside_the_model(arch: str, tmp_path: Path) -> None:
    """Each op of a whole prefill + decode run, CUDA vs torch on the same inputs (opcheck.py)."""
    pytest.importorskip("cuda.core")
    from mgserve.cuda.backend import cuda_backend, load_device_model, torch_backend
    from tests.cuda.opcheck import OpCheck

    dev = torch.device("cuda", 0)
    ops = OpCheck()
    backend = ops.backend(cuda_backend(0), torch_backend())
    model = load_device_model(GGUFFile(_export(arch, tmp_path)), backend, dev, 4, N_CTX)
    n_vocab = model.spec.n_vocab
    prompts = [_tokens(n, seed, n_vocab) for seed, n in enumerate(PROMPTS)]
    decode = [_tokens(3, 100 + i, n_vocab) for i in range(N_DECODE)]
    _device_run(model, dev, prompts, decode, slots=(2, 0, 3))
    for r in ops.worst(12):
        print(f"{arch}: {r.op} call {r.call} {r.what}: {r.err:.2e}")
    bad = ops.first_above(lambda op: OP_TOL.get(op, 1e-4))
    assert bad is None, f"{arch}: first op beyond tolerance: {bad}"
