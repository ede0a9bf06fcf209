from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, GGUFValueType

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.gguf.writer import GGUFWriter, tensor_nbytes
from mgserve.core.synth.blocks import make_pool
from mgserve.core.synth.vocab import SynthVocab

Q = GGMLQuantizationType
V = GGUFValueType


def _value(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_metadata_round_trip_every_type(tmp_path: Path) -> None:
    explicit = {
        "t.u8": (200, V.UINT8),
        "t.i8": (-100, V.INT8),
        "t.u16": (60000, V.UINT16),
        "t.i16": (-30000, V.INT16),
        "t.u32": (4_000_000_000, V.UINT32),
        "t.i32": (-2_000_000_000, V.INT32),
        "t.u64": (2**63 + 5, V.UINT64),
        "t.i64": (-(2**40), V.INT64),
        "t.f32": (0.5, V.FLOAT32),
        "t.f64": (1e300, V.FLOAT64),
        "t.bool": (True, V.BOOL),
        "t.str": ("héllo ✓", V.STRING),
        "t.arr_u64": ([2**64 - 1, 0, 7], V.UINT64),
        "t.arr_f32": ([1.5, -2.25], V.FLOAT32),
    }
    inferred = {
        "i.uint": (7, V.UINT32),  # llama.cpp reads integer keys as uint32
        "i.neg": (-7, V.INT32),
        "i.big": (2**40, V.INT64),
        "i.float": (1e-6, V.FLOAT32),
        "i.bool": (False, V.BOOL),
        "i.str": ("x", V.STRING),
        "i.arr_str": (["a", "", "ü"], V.STRING),
        "i.arr_int": ([1, -2, 3], V.INT32),
        "i.arr_bool": ([True, False], V.BOOL),
        "i.arr_float": ([1, 2.5], V.FLOAT32),
        "i.arr_np": (np.arange(5, dtype=np.uint16), V.UINT16),
    }
    path = tmp_path / "kv.gguf"
    with GGUFWriter(path, "llama") as w:
        for key, (value, vtype) in explicit.items():
            w.add(key, value, vtype)
        for key, (value, _) in inferred.items():
            w.add(key, value)
        w.write_header()

    r = GGUFReader(path)
    assert _value(r, "general.architecture") == "llama"
    for key, (value, vtype) in {**explicit, **inferred}.items():
        field = r.fields[key]
        got = field.contents()
        if isinstance(value, (list, np.ndarray)):
            assert field.types == [V.ARRAY, vtype], key
            assert got == pytest.approx(list(value)) if vtype == V.FLOAT32 else got == list(value)
        else:
            assert field.types == [vtype], key
            assert (
                got == pytest.approx(value, rel=1e-6) if isinstance(value, float) else got == value
            )
    assert len(r.tensors) == 0


def test_tensors_round_trip_bytes_and_alignment(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64), dtype=np.float32)  # numpy [rows, ne0]
    f16 = rng.standard_normal((2, 32)).astype(np.float16)
    q8 = make_pool(Q.Q8_0, rng, tensor_nbytes((64, 3), Q.Q8_0))
    q4k = make_pool(Q.Q4_K, rng, tensor_nbytes((512, 2), Q.Q4_K))
    tensors = {
        "a.f32": ((64, 3), Q.F32, f32),
        "b.f16": ((32, 2), Q.F16, f16),
        "c.q8_0": ((64, 3), Q.Q8_0, q8),
        "d.q4_k": ((512, 2), Q.Q4_K, q4k.tobytes()),
        "e.odd": ((5,), Q.F32, np.arange(5, dtype=np.float32)),  # 20 bytes: next one is padded
        "f.after": ((8,), Q.F32, np.ones(8, dtype=np.float32)),
    }
    for alignment in (32, 64):
        path = tmp_path / f"t{alignment}.gguf"
        with GGUFWriter(path, "llama", alignment=alignment) as w:
            w.add("x.key", 1)
            for name, (shape, gtype, _) in tensors.items():
                w.add_tensor_info(name, shape, gtype)
            w.write_header()
            for name, (_, _, data) in tensors.items():
                w.write_tensor_data(name, data)

        r = GGUFReader(path)
        if alignment != 32:
            assert _value(r, "general.alignment") == alignment
        assert [t.name for t in r.tensors] == list(tensors)
        for t in r.tensors:
            shape, gtype, data = tensors[t.name]
            raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
            assert t.tensor_type == gtype
            assert tuple(int(x) for x in t.shape) == shape
            assert t.data_offset % alignment == 0
            assert np.asarray(t.data).tobytes() == raw, t.name
        # mgserve's own reader sees the same table
        f = GGUFFile(path)
        assert f.tensors["d.q4_k"].type_name == "Q4_K" and f.tensors["d.q4_k"].shape == (512, 2)


def test_chunked_write_equals_whole(tmp_path: Path) -> None:
    data = np.arange(96, dtype=np.float32)
    path = tmp_path / "c.gguf"
    with GGUFWriter(path, None) as w:
        w.add_tensor_info("t", (32, 3), Q.F32)
        w.write_header()
        w.write_tensor_chunks("t", [data[:10], data[10:50].tobytes(), memoryview(data[50:])])
    t = GGUFReader(path).tensors[0]
    assert np.array_equal(np.asarray(t.data).reshape(-1), data)


def _writer(tmp_path: Path) -> GGUFWriter:
    w = GGUFWriter(tmp_path / "bad.gguf", "llama")
    w.add_tensor_info("blk.0.a", (32, 2), Q.Q8_0)
    w.add_tensor_info("blk.0.b", (4,), Q.F32)
    return w


def test_wrong_data_size_names_the_tensor(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    w.write_header()
    with pytest.raises(ValueError, match=r"'blk\.0\.a'.*got 67 bytes.*expected 68"):
        w.write_tensor_data("blk.0.a", bytes(67))
    with pytest.raises(ValueError, match=r"'blk\.0\.a'.*more than the expected 68"):
        w.write_tensor_data("blk.0.a", bytes(69))


def test_order_and_completeness_are_checked(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    with pytest.raises(ValueError, match="before write_header"):
        w.write_tensor_data("blk.0.a", bytes(68))
    w.write_header()
    with pytest.raises(ValueError, match=r"out of order; 'blk\.0\.a' is next"):
        w.write_tensor_data("blk.0.b", bytes(16))
    w.write_tensor_data("blk.0.a", bytes(68))
    with pytest.raises(ValueError, match=r"'blk\.0\.b'.*1 of 2 tensors missing"):
        w.close()


def test_bad_declarations(tmp_path: Path) -> None:
    w = GGUFWriter(tmp_path / "d.gguf", "llama")
    w.add("k", 1)
    with pytest.raises(ValueError, match="added twice"):
        w.add("k", 2)
    with pytest.raises(ValueError, match="does not fit UINT8"):
        w.add("k8", 300, V.UINT8)
    with pytest.raises(ValueError, match="cannot infer"):
        w.add("kn", None)
    with pytest.raises(ValueError, match=r"'q'.*row width 100 is not a multiple of the Q4_K block"):
        w.add_tensor_info("q", (100, 4), Q.Q4_K)
    w.add_tensor_info("t", (4,), Q.F32)
    with pytest.raises(ValueError, match="declared twice"):
        w.add_tensor_info("t", (4,), Q.F32)
    with pytest.raises(ValueError, match="alignment"):
        GGUFWriter(tmp_path / "e.gguf", "llama", alignment=12)


def _tiny_llama(path: Path) -> SynthVocab:
    """A 2-layer dense llama with random F32 weights and the synthetic BPE vocabulary."""
    vocab = SynthVocab(320, "qwen2", endoftext_id=300, im_start_id=301, im_end_id=302)
    e, ff, n_head, n_kv, hd = 64, 128, 4, 2, 16
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (e, 320),
        "output_norm.weight": (e,),
        "output.weight": (e, 320),
    }
    for il in range(2):
        b = f"blk.{il}."
        shapes |= {
            b + "attn_norm.weight": (e,),
            b + "attn_q.weight": (e, n_head * hd),
            b + "attn_k.weight": (e, n_kv * hd),
            b + "attn_v.weight": (e, n_kv * hd),
            b + "attn_output.weight": (n_head * hd, e),
            b + "ffn_norm.weight": (e,),
            b + "ffn_gate.weight": (e, ff),
            b + "ffn_up.weight": (e, ff),
            b + "ffn_down.weight": (ff, e),
        }
    rng = np.random.default_rng(1)
    with GGUFWriter(path, "llama") as w:
        for key, value in {
            "context_length": 64,
            "embedding_length": e,
            "block_count": 2,
            "feed_forward_length": ff,
            "attention.head_count": n_head,
            "attention.head_count_kv": n_kv,
            "rope.dimension_count": hd,
        }.items():
            w.add(f"llama.{key}", value)
        w.add("llama.attention.layer_norm_rms_epsilon", 1e-5)
        for key, (value, vtype) in vocab.metadata().items():
            w.add(key, value, vtype)
        for name, shape in shapes.items():
            w.add_tensor_info(name, shape, Q.F32)
        w.write_header()
        for name, shape in shapes.items():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            w.write_tensor_data(name, (base + 0.1 * rng.standard_normal(shape[::-1])).astype("<f4"))
    return vocab


def test_llama_cpp_loads_a_written_model(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (CI)")
    path = tmp_path / "tiny-llama.gguf"
    vocab = _tiny_llama(path)
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, n_threads=2, vocab_only=False, logits_all=True, verbose=False
    )
    assert llm.n_vocab() == vocab.n_vocab and llm.n_embd() == 64
    # byte-level BPE with our merges: " the" is one token (256 bytes + "Ġt", "Ġa", "he", "in",
    # "re", "on" -> "Ġthe" is id 262); "<|im_end|>" is a control token parsed as special
    assert llm.tokenize(b" the", add_bos=False) == [262]
    assert llm.tokenize(b"<|im_end|>", add_bos=False, special=True) == [vocab.im_end_id]
    llm.eval(llm.tokenize(b"hello the world", add_bos=False))
    logits = np.asarray(llm.scores[llm.n_tokens - 1])
    assert logits.shape == (320,) and np.isfinite(logits).all() and logits.std() > 0
