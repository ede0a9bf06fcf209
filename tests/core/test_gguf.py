"""GGUFFile metadata, ModelSpec, and the errors a broken or unsupported file gets."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from mgserve.core.gguf.hparams import spec_from_gguf
from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.models import load_model
from mgserve.core.reference.dequant import dequantize
from tests.core.tiny import gguf_tensors, hf_model, write_gguf


@pytest.fixture(scope="module")
def llama_parts():
    hf = hf_model("llama")
    return hf.config, gguf_tensors("llama", hf)


def _write(tmp_path: Path, llama_parts, arch: str = "llama", drop_keys=(), **tensor_edits) -> Path:
    cfg, tensors = llama_parts
    tensors = dict(tensors)
    for name, value in tensor_edits.items():
        name = name.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return write_gguf(tmp_path / "m.gguf", arch, cfg, tensors, drop_keys=drop_keys)


def test_metadata_arrays_are_fast_and_equal_gguf_py(tmp_path: Path) -> None:
    n = 200_000
    tokens = [f"tok{i}\u00e9" for i in range(n)]
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(n)])
    w.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t0 = time.perf_counter()
    g = GGUFFile(tmp_path / "t.gguf")
    elapsed = time.perf_counter() - t0
    meta = g.metadata
    assert meta["tokenizer.ggml.tokens"] == tokens
    assert meta["tokenizer.ggml.merges"] == ["a b", "c d"]
    assert len(meta["tokenizer.ggml.scores"]) == n and meta["tokenizer.ggml.scores"][7] == 7.0
    assert meta["general.architecture"] == "llama"
    assert elapsed < 2.0, f"opening took {elapsed:.2f} s"


def test_real_gemma_spec_and_fast_open(gemma_path: Path) -> None:
    t0 = time.perf_counter()
    g = GGUFFile(gemma_path)
    elapsed = time.perf_counter() - t0
    print(f"GGUFFile(gemma) opened in {elapsed:.2f} s")
    assert elapsed < 2.0
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 262144
    s = spec_from_gguf(g)
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.head_dim) == (18, 640, 4, 1, 256)
    assert s.n_vocab == 262144 and s.tied_output and s.rope_neox and s.qk_norm
    assert [il for il, swa in enumerate(s.swa_layers) if not swa] == [5, 11, 17]
    assert s.sliding_window == 512 and s.rope_base == 1e6 and s.rope_base_swa == 1e4
    assert s.attn_scale == pytest.approx(1 / 16)


def test_llama_spec(tmp_path: Path, llama_parts) -> None:
    s = spec_from_gguf(GGUFFile(_write(tmp_path, llama_parts)))
    assert s.arch == "llama" and not s.rope_neox and not s.tied_output
    assert (s.n_layer, s.n_embd, s.n_ff, s.n_gqa, s.head_dim) == (2, 64, 96, 2, 32)
    assert s.swa_layers == (False, False) and s.sliding_window == 0


def test_truncated_file_names_file_and_tensor(tmp_path: Path, llama_parts) -> None:
    path = _write(tmp_path, llama_parts)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"m\.gguf.*tensor '.*'.*truncated"):
        GGUFFile(path)


def test_garbage_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match=r"x\.gguf"):
        GGUFFile(tmp_path / "x.gguf")


def test_missing_tensor(tmp_path: Path, llama_parts) -> None:
    path = _write(tmp_path, llama_parts, blk__1__ffn_up__weight=None)
    with pytest.raises(GGUFError, match=r"m\.gguf.*'blk\.1\.ffn_up\.weight' is missing"):
        load_model(path)


def test_wrong_tensor_shape(tmp_path: Path, llama_parts) -> None:
    bad = np.zeros((32, 64), dtype=np.float32)  # torch order [out, in]: GGUF shape [64, 32]
    path = _write(tmp_path, llama_parts, blk__0__attn_k__weight=bad)
    with pytest.raises(
        GGUFError, match=r"'blk\.0\.attn_k\.weight' has shape \[64, 32\], expected \[64, 64\]"
    ):
        load_model(path)


def test_unknown_architecture(tmp_path: Path, llama_parts) -> None:
    path = _write(tmp_path, llama_parts, arch="mamba")
    with pytest.raises(
        GGUFError, match=r"m\.gguf.*'mamba'.*supported: llama, qwen2, qwen3, gemma3"
    ):
        load_model(path)


def test_missing_key(tmp_path: Path, llama_parts) -> None:
    path = _write(tmp_path, llama_parts, drop_keys=("block_count",))
    with pytest.raises(GGUFError, match=r"m\.gguf.*'llama\.block_count' is missing"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "q.gguf", "llama")
    block = np.zeros((1, 54), dtype=np.uint8)  # one TQ1_0 block: 256 values in 54 bytes
    w.add_tensor("odd.weight", block, raw_dtype=gguf.GGMLQuantizationType.TQ1_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "q.gguf")
    with pytest.raises(GGUFError, match=r"q\.gguf.*'odd\.weight' has type TQ1_0"):
        dequantize(g, g.tensor("odd.weight"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "F16", "BF16"])
def test_dequantize_matches_gguf_py(tmp_path: Path, qtype: str) -> None:
    t = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, t)
    w = gguf.GGUFWriter(tmp_path / "d.gguf", "llama")
    w.add_tensor("w", raw, raw_shape=raw.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "d.gguf")
    got = dequantize(g, g.tensor("w"))
    assert tuple(got.shape) == (3, 64)
    np.testing.assert_array_equal(got.numpy(), gguf.quants.dequantize(raw, t))
    assert np.abs(got.numpy() - x).max() < 0.2  # and it is x, give or take the quantization
