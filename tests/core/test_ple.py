"""PLE n-gram hash embedding pieces (mgserve/core/reference/ple.py): the hash against
transformers' ``Qwen4ExpTextNGramEmbedding``, row gathers from memory-mapped quantized tables, and
the dilated conv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from mgserve.core.gguf.hparams_qwen4exp import PleSpec
from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.gguf.writer import GGUFWriter
from mgserve.core.reference import ple, ple_rows
from mgserve.core.reference.dequant import dequantize
from tests.core.qwen4exp_export import VOCAB, hf_config
from tests.hf_version import pinned_transformers

EOS = VOCAB.im_end_id


@pytest.fixture(scope="module")
def hf_ngram() -> Any:
    """HF's n-gram embedding whose table row r holds the number r in its first column, so the
    embedding of a token tells which rows it hashed to."""
    pinned_transformers()
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    cfg = hf_config()
    emb = Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, layer_idx=1, ple_layer_index=0)
    with torch.no_grad():
        emb.ngram_embedding.weight.zero_()
        emb.ngram_embedding.weight[:, 0] = torch.arange(emb.ngram_embedding.weight.shape[0])
    return emb


@pytest.fixture(scope="module")
def spec(hf_ngram: Any) -> PleSpec:
    return PleSpec(
        layer=1,
        ngram=hf_ngram.ngram_size,
        heads_per_ngram=hf_ngram.heads_per_ngram,
        conv_kernel=4,
        eos=EOS,
        head_dim=hf_ngram.ngram_embedding.weight.shape[1],
        multipliers=tuple(hf_ngram.layer_multipliers.tolist()),
        offsets=tuple(hf_ngram.ngram_heads_offsets.tolist()),
        sizes=tuple(hf_ngram.ngram_heads_vocab_sizes.tolist()),
    )


def hf_rows(emb: Any, tokens: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        out = emb(tokens[None], past_key_values=None)  # [1, T, n_heads * head_dim]
    return out.view(tokens.numel(), -1, emb.ngram_embedding.weight.shape[1])[:, :, 0].numpy()


def test_hash_matches_transformers(hf_ngram: Any, spec: PleSpec) -> None:
    toks = torch.randint(0, VOCAB.endoftext_id, (60,), generator=torch.Generator().manual_seed(3))
    toks[[0, 10, 11, 25, 27, 59]] = EOS  # a leading EOS, two in a row, one with a gap of one
    start = np.full(spec.ngram - 1, EOS)
    want = hf_rows(hf_ngram, toks).astype(np.int64)
    got = ple.ngram_rows(toks.numpy(), start, spec)
    assert got.shape == (60, spec.n_heads)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 0])) > 40  # the rows really depend on the tokens


def test_hash_is_chunk_independent(spec: PleSpec) -> None:
    toks = np.random.default_rng(0).integers(0, 300, 50)
    toks[[5, 6, 30]] = EOS
    whole = ple.ngram_rows(toks, np.full(2, EOS), spec)
    parts, history = [], np.full(2, EOS)
    for lo, hi in ((0, 1), (1, 6), (6, 7), (7, 31), (31, 50)):
        parts.append(ple.ngram_rows(toks[lo:hi], history, spec))
        history = np.concatenate([history, toks[lo:hi]])[-2:]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_sessions_hashed_together_are_each_hashed_alone(spec: PleSpec) -> None:
    """A decode step hashes every session's contexts at once (qwen4exp's ``step_extra``): the
    same rows as each session's ``ngram_rows``, for histories with and without EOS."""
    rng = np.random.default_rng(2)
    sessions = [(rng.integers(0, 300, n), rng.integers(0, 300, 2)) for n in (1, 1, 4, 1)]
    sessions[1][1][1] = EOS  # the last token before a session's step is EOS
    sessions[3][1][0] = EOS
    alone = [ple.ngram_rows(t, h, spec) for t, h in sessions]
    joined = np.concatenate([ple.ngram_contexts(t, h, spec) for t, h in sessions], axis=1)
    np.testing.assert_array_equal(ple.hash_contexts(joined, spec), np.concatenate(alone))
    assert len({tuple(r) for r in np.concatenate(alone)}) > 5  # the sessions' rows differ


ROW_BYTES = {  # bytes of a 160-value row as each type stores it
    "F32": 640, "F16": 320, "BF16": 320, "Q8_0": 170, "Q4_0": 90, "Q4_1": 100, "Q5_0": 110,
    "Q5_1": 120, "IQ4_NL": 90,
}  # fmt: skip


def _write_table(path: Path, qtype: GGMLQuantizationType, width: int, rows: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    values = rng.standard_normal((rows, width)).astype(np.float32)
    if qtype == GGMLQuantizationType.IQ4_NL:  # gguf-py cannot quantize it: random valid blocks
        blocks = rng.integers(0, 256, size=(rows, width // 32, 18), dtype=np.uint8)
        scales = (rng.standard_normal((rows, width // 32)) / 100).astype(np.float16)
        blocks[..., :2] = scales[..., None].view(np.uint8).reshape(rows, width // 32, 2)
        data = blocks.reshape(rows, -1)
    elif qtype != GGMLQuantizationType.F32:
        data = quants.quantize(values, qtype)
    else:
        data = values
    with GGUFWriter(path, "test") as w:
        w.add_tensor_info("table", (width, rows), qtype)
        w.write_header()
        w.write_tensor_data("table", data)
    return values


@pytest.mark.parametrize("qtype", sorted(ROW_BYTES))
def test_gather_rows_equals_full_dequantize(tmp_path: Path, qtype: str) -> None:
    width = 160
    t = GGMLQuantizationType[qtype]
    _write_table(tmp_path / "t.gguf", t, width, 500)
    g = GGUFFile(tmp_path / "t.gguf")
    table = g.tensor("table")
    rows = np.array([[3, 499, 0], [3, 17, 250]])
    got = ple_rows.gather_rows(table, rows)  # [2, 3, width]
    assert got.shape == (2, 3, width) and got.dtype == torch.float32
    assert torch.equal(got, dequantize(g, table)[torch.from_numpy(rows)])
    assert ple_rows.advise_random(table)


@pytest.mark.parametrize("qtype", sorted(ROW_BYTES))
def test_packed_rows_unpack_to_the_gathered_rows(tmp_path: Path, qtype: str) -> None:
    """A prompt chunk's rows as stored (bytes), decoded with torch ops where they are used: the
    same bits as ``gather_rows`` (gguf's numpy dequantization), for every type a table of
    160-value rows can have (a Q4_K_M file's table is Q5_0)."""
    t = GGMLQuantizationType[qtype]
    _write_table(tmp_path / "t.gguf", t, 160, 500)
    table = GGUFFile(tmp_path / "t.gguf").tensor("table")
    rows = np.array([[3, 499, 0], [3, 17, 250], [1, 1, 1]])
    raw = ple_rows.packed_rows(table, rows)
    assert raw is not None and raw.dtype == torch.uint8 and raw.shape[0] == 3
    assert raw.shape[1] == 3 * ROW_BYTES[qtype]
    got = ple_rows.unpack_rows(raw, qtype)
    assert torch.equal(got, ple_rows.gather_rows(table, rows).flatten(1))
    none = ple_rows.packed_rows(table, np.zeros((0, 3), dtype=np.int64))  # an empty step
    assert none is not None and tuple(ple_rows.unpack_rows(none, qtype).shape) == (0, 3 * 160)


def test_check_table_needs_every_head_range(tmp_path: Path, spec: PleSpec) -> None:
    _write_table(tmp_path / "t.gguf", GGMLQuantizationType.F32, spec.head_dim, 1000)
    table = GGUFFile(tmp_path / "t.gguf").tensor("table")
    with pytest.raises(GGUFError, match="PLE head ranges"):
        ple.check_table(table, spec, tmp_path)


def test_dilated_conv_matches_conv1d_in_any_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(23, 6, generator=gen)  # [T, C]
    w = torch.randn(6, 4, generator=gen)  # [C, K]
    hist = 3 * 3
    padded = F.pad(x.T[None], (hist, 0))  # [1, C, hist + T]
    want = F.silu(F.conv1d(padded, w[:, None], dilation=3, groups=6))[0].T  # [T, C]
    state = torch.zeros(hist, 6)
    outs = []
    for lo, hi in ((0, 1), (1, 8), (8, 9), (9, 23)):
        y, state = ple.dilated_conv(x[lo:hi], state, w, 3)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(state, x[-hist:])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", sorted(ROW_BYTES))
def test_packed_rows_unpack_on_the_gpu_to_the_gathered_rows(tmp_path: Path, qtype: str) -> None:
    """As above with the torch ops on the GPU (where a prompt chunk decodes them)."""
    _write_table(tmp_path / "t.gguf", GGMLQuantizationType[qtype], 160, 500)
    table = GGUFFile(tmp_path / "t.gguf").tensor("table")
    rows = np.random.default_rng(2).integers(0, 500, size=(64, 16))
    raw = ple_rows.packed_rows(table, rows)
    assert raw is not None
    got = ple_rows.unpack_rows(raw.cuda(), qtype).cpu()
    assert torch.equal(got, ple_rows.gather_rows(table, rows).flatten(1))


def test_decode_contexts_are_each_sessions_contexts(spec: PleSpec) -> None:
    """A decode step's contexts of one token per session, made at once, are the columns of each
    session's ``ngram_contexts`` joined, for histories with EOS in any place."""
    rng = np.random.default_rng(5)
    hists = rng.integers(0, 300, (6, spec.ngram - 1))
    hists[1, -1] = EOS  # the token just before the step
    hists[2, 0] = EOS  # the oldest
    hists[3, :] = EOS  # a new session
    toks = rng.integers(0, 300, 6)
    toks[4] = EOS  # the token's own EOS does not cut
    want = np.concatenate(
        [ple.ngram_contexts(toks[i : i + 1], hists[i], spec) for i in range(6)], axis=1
    )
    np.testing.assert_array_equal(ple.decode_contexts(toks, hists, spec), want)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
def test_decode_blocks_is_ggufs_dequantization_bit_for_bit(qtype: str) -> None:
    """The host's numpy decoding of a decode step's rows (``gather_rows``' fast path) against
    gguf's on random bytes: every bit pattern of scales and quants (infinities and NaNs too)."""
    rng = np.random.default_rng(7)
    nbytes = ple_rows.PACKED[qtype][0]
    raw = rng.integers(0, 256, size=(24, 5 * nbytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = quants.dequantize(raw, GGMLQuantizationType[qtype]).reshape(24, -1)
        got = ple_rows.decode_blocks(raw, qtype)
    assert got.shape == (24, 160) and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    empty = ple_rows.decode_blocks(raw[:0], qtype)  # a step without rows
    assert empty.shape == (0, 160) and empty.dtype == np.float32
