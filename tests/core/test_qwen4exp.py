"""qwen4exp on the reference path against transformers 5.23 (float32) and llama.cpp (saved JSON).

The tiny model (tests/core/qwen4exp_export.py, the issue's config): hidden 256 on 4
hyper-connection streams, 8 layers (3 and 7 gated full attention with QSA: blocks of 4, 2 indexer
heads, budget 64 tokens; the others Gated DeltaNet, 4 key heads serving 8 value heads, sigmoid
output gate; PLE n-gram hash embedding on layer 1), 8 experts top-2 plus a shared expert.
Prompts of 300 tokens make QSA select 16 of up to 75 blocks; an EOS every 37 tokens resets the
n-gram window. Errors are max |diff| / max |logit| (``rel_error``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.gguf.reader import GGUFError
from mgserve.core.models import load_model
from mgserve.core.models.base import SeqInput
from mgserve.core.models.hybrid import load_hybrid
from mgserve.core.models.qwen4exp import Qwen4Exp
from mgserve.core.models.state_qwen4exp import Qwen4ExpState
from tests.core.hybrid_export import (
    batched_and_alone,
    file_sha256,
    hf_logits,
    rel_error,
    require_reference_file,
    run_chunks,
)
from tests.core.qwen4exp_export import (
    I32,
    U32,
    U64,
    export,
    hf_model,
    prompt_tokens,
    table_nbytes,
    write_synth_qwen4exp,
)

N_PROMPT = 300
N_STATE = 118  # prompt of the chunk-size test (chunks of 1 are slow): QSA selects from 67 on
EOS_EVERY = 37
TOL = 1e-4  # float32 reference vs float32 transformers: observed ~1e-5
DENSE_UNTIL = 67  # positions below this have at most 16 complete blocks: QSA is dense there


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    path = Path(__file__).resolve().parents[1] / "data" / "qwen4exp_llama_reference.json"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model()


@pytest.fixture(scope="module")
def gguf_path(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(hf, tmp_path_factory.mktemp("qwen4exp") / "qwen4exp.gguf")


@pytest.fixture(scope="module")
def lm(gguf_path: Path) -> Any:
    return load_hybrid(gguf_path)


@pytest.fixture(scope="module")
def tokens(refs: dict[str, Any]) -> torch.Tensor:
    """The prompt, then llama.cpp's greedy continuation (teacher-forced everywhere)."""
    toks = torch.tensor(refs["r4"]["tokens"])
    assert torch.equal(toks[:N_PROMPT], prompt_tokens(N_PROMPT, eos_every=EOS_EVERY))
    return toks


@pytest.fixture(scope="module")
def hf_ref(hf: Any, tokens: torch.Tensor) -> torch.Tensor:
    """HF logits: the prompt in one call, then one token per call through HF's cache."""
    return hf_logits(hf, tokens, N_PROMPT)


def new_state(lm: Any, n_ctx: int = 512) -> Any:  # Any until SeqInput.cache admits the state
    state = lm.new_cache(n_ctx, "f32", "f32")
    assert isinstance(state, Qwen4ExpState)
    return state


def prefill_decode(lm: Any, tokens: torch.Tensor, chunk: int, state: Any = None) -> torch.Tensor:
    state = new_state(lm) if state is None else state
    return torch.cat(
        [
            run_chunks(lm, state, tokens[:N_PROMPT], chunk),
            run_chunks(lm, state, tokens[N_PROMPT:], 1, start=N_PROMPT),  # decode steps
        ]
    )


def test_layout_and_state(lm: Any, gguf_path: Path) -> None:
    qp = lm.qp
    assert isinstance(load_model(gguf_path, threads=1), Qwen4Exp)  # registered for load_model
    assert lm.hybrid.recurrent == (True, True, True, False) * 2
    assert qp.hc == 4 and qp.qsa_layers == (3, 7) and qp.ratio == 4 and qp.idx_budget == 64
    assert qp.ple is not None and qp.ple.layer == 1 and qp.ple.n_heads == 16
    state = new_state(lm)
    assert state.ple_conv.shape == (9, 4 * 256) and state.ple_tokens.tolist() == [319, 319]
    assert state.blocks.shape == (2, 128, 32) and state.pending.shape == (2, 4, 32)
    assert state.ssm.shape == (6, 8, 32, 32)


@pytest.mark.parametrize("chunk", [N_PROMPT, 64, 7])
def test_prefill_and_decode_match_transformers(
    lm: Any, tokens: torch.Tensor, hf_ref: torch.Tensor, chunk: int
) -> None:
    got = prefill_decode(lm, tokens, chunk)
    assert rel_error(got[:N_PROMPT], hf_ref[:N_PROMPT]) <= TOL
    assert rel_error(got[N_PROMPT:], hf_ref[N_PROMPT:]) <= TOL


def test_qsa_really_selects(lm: Any, tokens: torch.Tensor, hf_ref: torch.Tensor) -> None:
    """Dense attention (a budget past the context) matches transformers only while QSA is dense."""
    dense = Qwen4Exp.__new__(Qwen4Exp)
    dense.__dict__ = dict(lm.__dict__, qp=dataclasses.replace(lm.qp, idx_budget=10**6))
    got = run_chunks(dense, new_state(dense), tokens[:N_PROMPT], N_PROMPT)
    assert rel_error(got[:DENSE_UNTIL], hf_ref[:DENSE_UNTIL]) <= TOL
    assert rel_error(got[DENSE_UNTIL:], hf_ref[DENSE_UNTIL:N_PROMPT]) > 0.05


def _state_tensors(st: Any, n: int) -> dict[str, torch.Tensor]:
    """The parts of a state at position n that are defined (pending: only if a block is open)."""
    parts = {
        "ssm": st.ssm,
        "conv": st.conv,
        "kv": st.kv.read(st.kv_index[3], n)[0],
        "ple_conv": st.ple_conv,
        "blocks": st.blocks[:, : n // 4],
    }
    if n % 4:
        parts["pending"] = st.pending[:, : n % 4]
    return parts


def test_chunk_sizes_give_the_same_state(lm: Any, tokens: torch.Tensor) -> None:
    prompt = tokens[:N_STATE]
    whole = new_state(lm)
    want = run_chunks(lm, whole, prompt, N_STATE)[-1]
    for chunk in (1, 7, 64):
        state = new_state(lm)
        got = run_chunks(lm, state, prompt, chunk)[-1]
        assert torch.equal(state.ple_tokens, whole.ple_tokens) and state.pos == N_STATE
        # Each layer's state is a function of rounded activations from the layers below it, so
        # "the same" is up to float32 rounding, measured against each tensor's own scale.
        errors = {"logits": rel_error(got, want)}
        ours, theirs = _state_tensors(state, N_STATE), _state_tensors(whole, N_STATE)
        errors |= {k: rel_error(ours[k], theirs[k]) for k in ours}
        assert max(errors.values()) <= 5e-5, (chunk, errors)
    assert whole.ple_conv.abs().max() > 0.1 and whole.blocks[:, : N_STATE // 4].abs().min() > 0


def test_snapshot_restore_is_exact(lm: Any, tokens: torch.Tensor) -> None:
    state = new_state(lm)
    run_chunks(lm, state, tokens[:90], 64)  # 90 % 4 = 2: a pending block half full
    snap = state.snapshot()

    def cont() -> torch.Tensor:
        a = run_chunks(lm, state, tokens[90:110], 64, start=90)
        return torch.cat([a, run_chunks(lm, state, tokens[110:114], 1, start=110)])

    first = cont()
    end = {k: v.clone() for k, v in _state_tensors(state, 114).items()}
    # a rejected detour (other tokens, an EOS), then back to the snapshot
    state.restore(snap)
    run_chunks(lm, state, tokens[10:30], 5, start=90)
    assert not torch.equal(state.ple_conv, end["ple_conv"])
    state.restore(snap)
    assert torch.equal(cont(), first)
    for key, value in _state_tensors(state, 114).items():
        assert torch.equal(value, end[key]), key


def test_copy_is_independent(lm: Any, tokens: torch.Tensor) -> None:
    state = new_state(lm)
    run_chunks(lm, state, tokens[:80], 64)
    fork = state.copy()
    a = run_chunks(lm, fork, tokens[80:85], 1, start=80)
    assert state.pos == 80 and fork.pos == 85
    b = run_chunks(lm, state, tokens[80:85], 1, start=80)
    assert torch.equal(a, b)


def test_sessions_batched_equal_alone(lm: Any, tokens: torch.Tensor) -> None:
    """Six decoders (past and before the QSA budget), a prompt chunk and a first chunk together."""
    starts = (150, 30, 7, 201, 68, 95, 140, 0)
    sizes = (1, 1, 1, 1, 1, 1, 9, 20)
    together, alone, states, forks = batched_and_alone(lm, new_state, tokens, starts, sizes)
    # bit for bit: concurrency never changes results (DESIGN.md)
    assert torch.equal(together, alone)
    for st, f in zip(states, forks, strict=True):
        n = st.pos
        for key, value in _state_tensors(st, n).items():
            assert torch.equal(value, _state_tensors(f, n)[key]), key


def test_wrong_start_or_state_is_rejected(lm: Any, tokens: torch.Tensor) -> None:
    state = new_state(lm)
    run_chunks(lm, state, tokens[:10], 64)
    before = state.snapshot()
    with pytest.raises(ValueError, match="recurrent state is at position 10"):
        lm.forward([SeqInput(state, tokens[5:8], 5, 1)])
    assert state.pos == 10 and torch.equal(state.ple_tokens, before.ple_tokens)
    with pytest.raises(ValueError, match="Qwen4ExpState"):
        lm.forward([SeqInput(lm.new_cache(16).kv, tokens[:3], 0, 1)])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ple.layers", ([3], U32), "PLE layer 3 is not a linear attention layer"),
        ("rope.dimension_sections", ([2, 2, 2, 2], I32), "4th M-RoPE section"),
        ("attention.indexer.top_k", (66, U32), "not a multiple of 4"),
        ("hyper_connection.count", (1, U32), "hyper-connections need count >= 2"),
        ("ple.head_vocab_sizes", ([1009] * 8, U64), "at least 16 are required"),
    ],
)
def test_bad_metadata_is_rejected(
    hf: Any, tmp_path: Path, key: str, value: tuple[Any, Any], message: str
) -> None:
    path = export(hf, tmp_path / "bad.gguf", overrides={f"qwen4exp.{key}": value})
    with pytest.raises(GGUFError, match=message):
        load_hybrid(path)


def _llama_run(lm: Any, ref: dict[str, Any]) -> torch.Tensor:
    toks, n = torch.tensor(ref["tokens"]), ref["n_prompt"]
    state = new_state(lm)
    return torch.cat([run_chunks(lm, state, toks[:n], n), run_chunks(lm, state, toks[n:], 1, n)])


def test_matches_llama_cpp_blocks_of_one(refs: dict[str, Any], tmp_path: Path) -> None:
    """Blocks of one token (8 indexer heads): llama.cpp's cell ranking is then the reference's
    block ranking, so llama.cpp must agree at every position while QSA selects 64 of up to 307
    tokens (F32 weights and KV: only float rounding order differs, observed ~6e-6)."""
    ref = refs["r1"]
    path = export(hf_model(indexer_compress_ratio=1, indexer_n_heads=8), tmp_path / "r1.gguf")
    require_reference_file(path, ref, "tests/data/make_qwen4exp_reference.py")
    got = _llama_run(load_hybrid(path), ref)
    top5, top5_logits = torch.tensor(ref["top5"]), torch.tensor(ref["top5_logits"])
    assert torch.equal(got.argmax(dim=1), top5[:, 0])
    assert rel_error(torch.gather(got, 1, top5), top5_logits) <= TOL
    assert rel_error(got[-1], torch.tensor(ref["last_logits"])) <= TOL
    assert rel_error(got[N_PROMPT - 1], torch.tensor(ref["last_prompt_logits"])) <= TOL


def test_matches_llama_cpp_blocks_of_four(
    lm: Any, gguf_path: Path, refs: dict[str, Any], hf_ref: torch.Tensor
) -> None:
    """The issue's model: llama.cpp ranks cells (top 64 + 3), so past position 66 it also attends
    a few cells of each query's 17th-best block, and breaks equal block scores its own way (see
    tests/data/make_qwen4exp_reference.py). Where QSA is dense it must agree to float rounding;
    after, we bound the drift by what llama.cpp shows against transformers itself (max ~0.21,
    top-1 agreement 0.93) and ask that mgserve be the one that matches transformers."""
    ref = refs["r4"]
    require_reference_file(gguf_path, ref, "tests/data/make_qwen4exp_reference.py")
    got = _llama_run(lm, ref)
    top5, top5_logits = torch.tensor(ref["top5"]), torch.tensor(ref["top5_logits"])
    ours = torch.gather(got, 1, top5)
    dense = slice(0, DENSE_UNTIL)
    assert rel_error(ours[dense], top5_logits[dense]) <= TOL
    assert torch.equal(got[dense].argmax(dim=1), top5[dense, 0])
    scale = float(top5_logits.abs().max())
    assert float((ours - top5_logits).abs().max()) / scale < 0.3
    assert (got.argmax(dim=1) == top5[:, 0]).float().mean() >= 0.85
    assert rel_error(got, hf_ref) <= TOL  # the difference is llama.cpp's, not ours


def test_quantized_real_layout_matches_llama_cpp(refs: dict[str, Any], tmp_path: Path) -> None:
    """A tiny file in the real layout and quant mix (Q4_K/Q5_0/Q8_0 weights, Q8_0 PLE table, BF16
    hyper-connections and indexer), 100 prompt tokens so QSA selects. On quantized weights
    llama.cpp rounds each activation row to 8 bits before the integer dot products (mgserve
    multiplies exact dequantized floats): logits of scale ~0.4 move by ~0.004 (observed max
    0.01), which can also flip a near-tied expert choice or QSA block. We bound the typical and
    the worst difference and ask for top-1 agreement at most positions."""
    ref = refs["synth"]
    path = write_synth_qwen4exp(tmp_path / "synth.gguf")
    assert file_sha256(path) == ref["gguf_sha256"], "rerun tests/data/make_qwen4exp_reference.py"
    lm = load_hybrid(path)
    toks, n = torch.tensor(ref["tokens"]), ref["n_prompt"]
    state = new_state(lm)
    got = torch.cat([run_chunks(lm, state, toks[:n], 16), run_chunks(lm, state, toks[n:], 1, n)])
    top5, top5_logits = torch.tensor(ref["top5"]), torch.tensor(ref["top5_logits"])
    diff = (torch.gather(got, 1, top5) - top5_logits).abs().amax(dim=1)  # [T]
    assert diff.median() < 0.01 and diff.max() < 0.04
    assert (got.argmax(dim=1) == top5[:, 0]).float().mean() >= 0.9


def _rss() -> int:
    """Resident set size of this process in bytes (/proc/self/status VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_big_ple_table_stays_on_disk(hf: Any, tokens: torch.Tensor, tmp_path: Path) -> None:
    """A 4 GiB PLE table (a hole in a sparse file: no disk used) costs RSS only for the model's
    other weights (~30 MiB) and the pages of the few rows each token gathers (100 tokens x 16
    rows x one 4 KiB page: ~6 MiB, thanks to MADV_RANDOM)."""
    rows = 64 * 2**20  # x 16 floats = 4 GiB
    path = export(hf, tmp_path / "big.gguf", sparse_ple_rows=rows)
    table = table_nbytes(hf, rows)
    assert table == 4 * 2**30 and path.stat().st_size > table
    assert path.stat().st_blocks * 512 < 2**30  # sparse: the table takes no disk
    before = _rss()
    big = load_hybrid(path)
    logits = run_chunks(big, new_state(big), tokens[:100], 50)
    grown = _rss() - before
    assert torch.isfinite(logits).all()
    assert grown < table / 40, f"RSS grew by {grown / 2**20:.0f} MiB for a {table >> 20} MiB table"
