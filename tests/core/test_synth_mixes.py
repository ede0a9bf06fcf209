"""The quant mixes of mgserve/core/synth/mixes.py: ``q4_k_m`` tensor by tensor against the types
llama.cpp's ``llama-quantize ... Q4_K_M`` chose for the same files (tests/data/q4_k_m_types.json,
made by tests/data/make_q4_k_m_types.py), and each mix's ``general.file_type``."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.synth.mixes import MIXES, fallback, mix_of
from mgserve.core.synth.shapes import SHAPES
from mgserve.core.synth.tensors import tensor_plan
from mgserve.core.synth.write import planned_bytes, write_synth
from tests.data.make_q4_k_m_types import config_spec

Q = GGMLQuantizationType
RECORDED = json.loads((Path(__file__).parents[1] / "data" / "q4_k_m_types.json").read_text())


def _expand(types: dict[str, str]) -> dict[str, str]:
    """The recorded ``blk.<layers>.<rest>`` patterns back to one entry per tensor."""
    out = {}
    for pattern, t in types.items():
        m = re.fullmatch(r"blk\.([\d,]+)\.(.+)", pattern)
        if m:
            for il in m.group(1).split(","):
                out[f"blk.{il}.{m.group(2)}"] = t
        else:
            out[pattern] = t
    return out


@pytest.mark.parametrize("name", sorted(RECORDED["configs"]))
def test_q4_k_m_matches_llama_quantize(name: str) -> None:
    record = RECORDED["configs"][name]
    want = _expand(record["types"])
    plan = tensor_plan(config_spec(**record["config"]), "q4_k_m")
    got = {p.name: p.ggml_type.name for p in plan}
    assert sorted(got) == sorted(want)
    wrong = {n: (got[n], want[n]) for n in got if got[n] != want[n]}
    assert not wrong, f"(ours, llama.cpp's): {wrong}"


def test_full_width_q4_k_m() -> None:
    """The issue-10 file's layout: quantized hyper-connections, K-quant fallbacks at 640/320/160
    wide rows, and every type one the device synth can make."""
    spec = SHAPES["qwen4exp-flash-next"]
    plan = {p.name: p.ggml_type for p in tensor_plan(spec, "q4_k_m")}
    assert plan["blk.0.hc_attn_down.weight"] == Q.Q4_K  # 10240 wide
    assert plan["blk.0.hc_attn_up.weight"] == Q.Q5_0  # 320 wide: Q4_K's fallback
    assert plan["output.weight"] == Q.Q6_K and plan["token_embd.weight"] == Q.Q4_K
    assert plan["per_layer_token_embd.weight"] == Q.Q5_0  # 160 wide
    assert plan["blk.0.ffn_down_exps.weight"] == Q.Q8_0  # Q6_K layer, 640 wide
    assert plan["blk.6.ffn_down_exps.weight"] == Q.Q5_0
    assert plan["blk.0.hc_ffn_down.weight"] == Q.Q6_K  # "ffn_down" in its name
    assert plan["blk.6.hc_ffn_down.weight"] == Q.Q4_K
    assert plan["blk.3.indexer.q_proj.weight"] == Q.BF16  # llama-quantize keeps it
    assert plan["blk.1.ple_conv1d.weight"] == Q.F16  # 4 wide: no block fits
    assert {t.name for t in plan.values()} == {"F32", "F16", "BF16", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert planned_bytes(spec, "q4_k_m") < planned_bytes(spec, "ud-q4_k_xl")


def test_fallback() -> None:
    assert fallback(Q.Q4_K, 2560) == Q.Q4_K
    assert fallback(Q.Q4_K, 640) == Q.Q5_0
    assert fallback(Q.Q6_K, 160) == Q.Q8_0
    assert fallback(Q.Q4_K, 4) == Q.F16
    for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        assert GGML_QUANT_SIZES[fallback(t, 96)][0] == 32


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_written_file_says_its_mix(mix: str, tmp_path: Path) -> None:
    spec = config_spec("qwen3next-80b-a3b", 4, 2)
    spec = dataclasses.replace(spec, n_embd=256, n_ff_exp=64, n_ff_shexp=64)
    path = write_synth(spec, tmp_path / "m.gguf", mix=mix).path
    f = GGUFFile(path)
    assert f.require("general.file_type") == mix_of(mix).file_type
    assert {n: t.type_name for n, t in f.tensors.items()} == {
        p.name: p.ggml_type.name for p in tensor_plan(spec, mix)
    }
    want = LlamaFileType.MOSTLY_BF16 if mix == "bf16" else LlamaFileType.MOSTLY_Q4_K_M
    assert f.require("general.file_type") == want
    with pytest.raises(ValueError, match="unknown quant mix"):
        mix_of("q3_k_s")
