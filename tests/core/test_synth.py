from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.synth import write as synth
from mgserve.core.synth.blocks import FP16_FIELDS, BlockSource, make_pool
from mgserve.core.synth.mixes import mix_of, use_more_bits
from mgserve.core.synth.shapes import SHAPES, ShapeSpec, metadata, ple_table
from mgserve.core.synth.tensors import tensor_plan
from mgserve.core.synth.vocab import SynthVocab

Q = GGMLQuantizationType
QWEN4EXP = SHAPES["qwen4exp-flash-next"]
QWEN3NEXT = SHAPES["qwen3next-80b-a3b"]


def _tiny(spec: ShapeSpec) -> ShapeSpec:
    """Same structure at toy widths: 4 layers (3 DeltaNet + 1 attention), 4 experts."""
    tiny = dict(
        n_embd=256,
        n_head=4,
        head_dim=64,
        n_rot=16,
        ssm_k_heads=2,
        ssm_v_heads=4,
        ssm_head_dim=32,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=64,
        n_ff_shexp=64,
        n_layer=4,
        vocab=SynthVocab(512, spec.vocab.pre, 400, 401, 402),
    )
    if spec.hc:
        tiny |= dict(
            hc_lowrank=32,
            indexer_heads=2,
            indexer_dim=32,
            indexer_top_k=8,
            ple_dim=16,
            ple_rows=4096,
            image_token_id=403,
            rope_sections=(3, 3, 2, 0),
        )
    return dataclasses.replace(spec, **tiny)


@pytest.fixture(scope="module", params=["qwen4exp", "qwen3next"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    spec = _tiny(QWEN4EXP if request.param == "qwen4exp" else QWEN3NEXT)
    path = tmp_path_factory.mktemp("synth") / f"{request.param}.gguf"
    return spec, synth.write_synth(spec, path, seed=3)


def test_file_matches_the_plan(written) -> None:
    spec, res = written
    plan = tensor_plan(spec)
    reader = GGUFReader(res.path)
    assert res.n_tensors == len(plan) == len(reader.tensors)
    for p, t in zip(plan, reader.tensors, strict=True):
        assert (t.name, tuple(int(x) for x in t.shape), t.tensor_type) == p
    f = GGUFFile(res.path)
    assert f.architecture == spec.arch
    assert list(f.tensors) == [p.name for p in plan]
    assert {n: (t.type_name, t.shape) for n, t in f.tensors.items()} == {
        p.name: (p.ggml_type.name, p.shape) for p in plan
    }
    assert f.require(f"{spec.arch}.block_count") == 4
    assert f.require(f"{spec.arch}.expert_count") == 4
    assert len(f.require("tokenizer.ggml.tokens")) == spec.vocab.n_vocab
    assert res.n_bytes >= synth.planned_bytes(spec)
    # the loader's strict types: scalar ints uint32, PLE ranges uint64
    fields = reader.fields
    assert fields[f"{spec.arch}.block_count"].types == [GGUFValueType.UINT32]
    if spec.ple_layer is not None:
        key = f"{spec.arch}.ple.head_offsets"
        assert fields[key].types == [GGUFValueType.ARRAY, GGUFValueType.UINT64]
        offsets, sizes = f.require(key), f.require(f"{spec.arch}.ple.head_vocab_sizes")
        rows = f.tensor("per_layer_token_embd.weight").shape[1]
        assert len(sizes) == spec.ple_heads and int(offsets[-1]) + int(sizes[-1]) <= rows


def test_weights_are_finite_and_small(written) -> None:
    _, res = written
    for t in GGUFReader(res.path).tensors:
        values = dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(values).all(), t.name
        assert np.abs(values).max() < 5.0, t.name


def test_every_scale_field_is_a_small_finite_half() -> None:
    rng = np.random.default_rng(0)
    for gtype, offsets in FP16_FIELDS.items():
        size = GGML_QUANT_SIZES[gtype][1]
        blocks = make_pool(gtype, rng, 1000 * size).reshape(-1, size)
        for off in offsets:
            d = blocks[:, off : off + 2].copy().view("<f2").astype(np.float32)
            assert np.isfinite(d).all() and (d > 0).all() and (d <= 1.001e-3).all(), gtype.name


def test_block_source_streams_exact_sizes() -> None:
    src = BlockSource(seed=1, pool_bytes=1 << 16)
    n = GGML_QUANT_SIZES[Q.Q4_K][1] * 1000  # > pool: wraps around
    chunks = list(src.chunks(Q.Q4_K, n))
    assert sum(c.nbytes for c in chunks) == n and len(chunks) > 1
    with pytest.raises(ValueError, match="IQ2_XXS"):
        list(src.chunks(Q.IQ2_XXS, 66))


def test_full_size_ud_type_policy() -> None:
    plan = {p.name: p for p in tensor_plan(QWEN4EXP, "ud-q4_k_xl")}
    assert len([n for n in plan if n.endswith("ffn_up_exps.weight")]) == 48
    assert plan["per_layer_token_embd.weight"].ggml_type == Q.Q8_0
    assert plan["per_layer_token_embd.weight"].shape[0] == 160
    assert plan["per_layer_token_embd.weight"].shape[1] == ple_table(QWEN4EXP)[2]
    assert 320_000_000 < plan["per_layer_token_embd.weight"].shape[1] < 320_100_000
    assert plan["output.weight"].ggml_type == Q.Q6_K
    assert plan["token_embd.weight"] == ("token_embd.weight", (2560, 248320), Q.Q4_K)
    assert plan["blk.3.attn_q.weight"].shape == (2560, 2 * 24 * 256)
    assert plan["blk.0.ffn_gate_exps.weight"] == (
        "blk.0.ffn_gate_exps.weight",
        (2560, 640, 512),
        Q.Q4_K,
    )
    # 640-wide rows cannot hold 256-value K-quant blocks: Q4_K -> Q5_0, Q6_K -> Q8_0
    for il in range(48):
        down = plan[f"blk.{il}.ffn_down_exps.weight"]
        assert down.ggml_type == (Q.Q8_0 if use_more_bits(il, 48) else Q.Q5_0)
    assert plan["blk.0.hc_attn_up.weight"] == ("blk.0.hc_attn_up.weight", (320, 10240), Q.BF16)
    # the converter's layout: the reshape-allowed norm gammas stay 1-D [n_embd * hc]
    reshape_ok = ["output_hc_norm.weight", "blk.47.hc_attn_norm.weight", "blk.0.hc_ffn_norm.weight"]
    reshape_ok += [f"blk.1.ple_norm_{k}.weight" for k in ("key", "query", "conv")]
    for name in reshape_ok:
        assert plan[name] == (name, (10240,), Q.F32)
    for name, p in plan.items():
        if "norm" in name or len(p.shape) == 1:
            assert p.ggml_type == Q.F32, name
        assert p.shape[0] % GGML_QUANT_SIZES[p.ggml_type][0] == 0, name
    q3n = {p.name: p for p in tensor_plan(QWEN3NEXT, "ud-q4_k_xl")}
    assert q3n["blk.0.ssm_ba.weight"].shape == (2048, 64)
    assert "output_norm.weight" in q3n and "output_norm.weight" not in plan
    assert q3n["blk.1.ffn_down_exps.weight"].ggml_type == Q.Q6_K  # 512 wide: K-quants fit
    assert 40e9 < synth.planned_bytes(QWEN3NEXT, "ud-q4_k_xl") < 55e9


def test_shrink_validates() -> None:
    small = QWEN4EXP.shrink(experts=8, ple_rows=10_000, layers=4)
    assert (small.n_expert, small.n_expert_used, small.n_layer, small.ple_rows) == (8, 8, 4, 10_000)
    with pytest.raises(ValueError, match="--experts"):
        QWEN4EXP.shrink(experts=0)
    with pytest.raises(ValueError, match="--layers must be in \\[2, 48\\]"):
        QWEN4EXP.shrink(layers=1)
    with pytest.raises(ValueError, match="no PLE table"):
        QWEN3NEXT.shrink(ple_rows=100_000)
    with pytest.raises(ValueError, match="--ple-rows"):
        QWEN4EXP.shrink(ple_rows=10)


def test_cli_dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    synth.add_arguments(p)
    out = tmp_path / "x.gguf"
    cmd = "--shape qwen3next-80b-a3b --layers 8 --experts 32 --dry-run --out"
    args = p.parse_args([*cmd.split(), str(out)])
    assert synth.run(args) == 0
    assert "8 layers, 32 experts" in capsys.readouterr().out and not out.exists()


def test_llama_cpp_runs_tiny_qwen4exp(written) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (CI)")
    spec, res = written
    llm = llama_cpp.Llama(str(res.path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    assert llm.n_vocab() == spec.vocab.n_vocab and llm.n_embd() == spec.n_embd
    llm.eval(llm.tokenize(b"hello the world", add_bos=False))
    logits = np.asarray(llm.scores[llm.n_tokens - 1])
    assert np.isfinite(logits).all() and logits.std() > 0


def test_cli_refuses_what_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = argparse.ArgumentParser()
    synth.add_arguments(p)
    args = p.parse_args(["--shape", "qwen3next-80b-a3b", "--out", str(tmp_path / "no/x.gguf")])
    with pytest.raises(ValueError, match="does not exist"):
        synth.run(args)
    monkeypatch.setattr(synth, "planned_bytes", lambda spec, mix: 10**18)
    args = p.parse_args(["--shape", "qwen3next-80b-a3b", "--out", str(tmp_path / "x.gguf")])
    with pytest.raises(ValueError, match="needs 1000000000.0 GB but only"):
        synth.run(args)
    assert not (tmp_path / "x.gguf").exists()


def test_qwen4exp_synth_has_the_real_tokenizer_and_template() -> None:
    """The synthetic qwen4exp file names Qwen3.5's pre-tokenizer and carries its chat template
    (package data copied from llama.cpp's models/templates/Qwen3.5-4B.jinja)."""
    from importlib.resources import files

    md = metadata(QWEN4EXP, mix_of("q4_k_m").file_type)
    assert md["tokenizer.ggml.pre"][0] == "qwen35"
    data = files("mgserve.core.text") / "data"
    want = (data / "qwen35_template.jinja").read_text(encoding="utf-8")
    assert md["tokenizer.chat_template"][0] == want
    assert "<|im_start|>" in want and "tool_call" in want
    md = metadata(QWEN3NEXT, mix_of("q4_k_m").file_type)
    assert md["tokenizer.chat_template"][0] != want  # qwen3next: ChatML
