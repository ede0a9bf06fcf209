"""Every tensor form llama.cpp's loader accepts loads in mgserve, to the same model.

Each case rewrites a tiny exported file into another form llama.cpp takes (src/llama-model.cpp
``create_tensor_qkv``, ``create_tensor_gate_up_exps``, the archs' ``load_arch_tensors`` and
``load_hparams``) and checks that the reference model gives the same logits as on the plain file,
and that the device model (torch backend, CPU) matches the reference on the rewritten file:

- dense archs: q/k/v fused into ``attn_qkv`` (``convert_hf_to_gguf.py --fuse-qkv``), biases fused
  too (qwen2); llama with the optional ``attn_output`` / ``ffn_*`` biases;
- qwen3next: fused ``attn_qkv`` on the attention layers, the legacy fused ``ssm_in`` on the
  DeltaNet layers, per-layer arrays for head counts and ``feed_forward_length`` with no
  ``expert_shared_feed_forward_length`` (the shared expert is then ``n_ff`` wide), and an appended
  MTP block (``nextn_predict_layers``);
- qwen4exp: hyper-connection / PLE norms as [n_embd, hc] and as the converter's 1-D
  [n_embd * hc] (``TENSOR_ALLOW_RESHAPE``) load to identical weights.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from mgserve.core.gguf.reader import GGUFError, GGUFFile
from mgserve.core.gguf.writer import GGUFWriter
from mgserve.core.models import load_model
from mgserve.core.models.base import SeqInput
from mgserve.core.models.hybrid_weights import ssm_in_rows

Tensors = dict[str, np.ndarray]  # name -> float32 array in torch order (reversed GGUF shape)
Meta = dict[str, tuple[Any, GGUFValueType]]


pytestmark = pytest.mark.usefixtures("one_thread")


def rewrite(
    src: Path,
    dst: Path,
    edit: Callable[[Tensors, Meta], None],
) -> Path:
    """Copy the F32 file ``src`` to ``dst`` with its tensors and metadata changed by ``edit``."""
    g = GGUFFile(src)
    meta: Meta = {}
    for key, fld in g._reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        array = fld.types[0] == GGUFValueType.ARRAY
        meta[key] = (g.metadata[key], fld.types[1] if array else fld.types[0])
    tensors: Tensors = {}
    for t in g:
        assert t.type_name == "F32", t.name
        tensors[t.name] = np.array(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape)))
    edit(tensors, meta)
    with GGUFWriter(dst, g.architecture) as w:
        for key, (value, vtype) in meta.items():
            w.add(key, value, vtype)
        for name, arr in tensors.items():
            w.add_tensor_info(name, tuple(reversed(arr.shape)), GGMLQuantizationType.F32)
        w.write_header()
        for name, arr in tensors.items():
            w.write_tensor_data(name, np.ascontiguousarray(arr))
    return dst


def logits(path: Path, n: int = 40) -> torch.Tensor:
    """Reference logits [n, V] of a fixed prompt, in one prefill."""
    lm = load_model(path, threads=1)
    toks = torch.randint(0, lm.spec.n_vocab, (n,), generator=torch.Generator().manual_seed(5))
    cache = lm.new_cache(128, "f32", "f32")
    return lm.forward([SeqInput(cache, toks, 0, n)])


def device_matches_reference(arch: str, path: Path) -> None:
    """tests/cuda/test_device_models.py's comparison; the reference breaks QSA score ties like the
    device (tests/cuda/conftest.py ``stable_qsa_ties``)."""
    from mgserve.core.reference import qsa
    from mgserve.cuda.backend import torch_backend
    from tests.cuda.test_device_models import TOL_TORCH, _compare

    torch.manual_seed(0)
    with mock.patch.object(qsa, "select", functools.partial(qsa.select, stable=True)):
        _compare(arch, path, torch_backend(), torch.device("cpu"), TOL_TORCH)


def _layers(tensors: Tensors) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in tensors if k.startswith("blk.")})


def fuse_qkv(tensors: Tensors, layers: list[int] | None = None) -> None:
    """attn_q/k/v (weights, and biases where all three exist) -> attn_qkv, rows [q | k | v]."""
    for il in _layers(tensors) if layers is None else layers:
        for kind in ("weight", "bias"):
            names = [f"blk.{il}.attn_{x}.{kind}" for x in "qkv"]
            if all(n in tensors for n in names):
                tensors[f"blk.{il}.attn_qkv.{kind}"] = np.concatenate(
                    [tensors.pop(n) for n in names]
                )


@pytest.fixture(scope="module")
def dense_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.core import tiny

    root = tmp_path_factory.mktemp("dense")
    return {
        arch: tiny.export(tiny.hf_model(arch), arch, root / f"{arch}.gguf")
        for arch in ("llama", "qwen2", "qwen3", "gemma3")
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_dense_fused_qkv(arch: str, dense_files: dict[str, Path], tmp_path: Path) -> None:
    src = dense_files[arch]
    fused = rewrite(src, tmp_path / "fused.gguf", lambda t, m: fuse_qkv(t))
    names = GGUFFile(fused).tensors
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    if arch == "qwen2":
        assert "blk.0.attn_qkv.bias" in names
    assert torch.equal(logits(fused), logits(src))
    device_matches_reference(arch, fused)


def test_llama_optional_biases(dense_files: dict[str, Path], tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def add_biases(t: Tensors, m: Meta) -> None:
        for il in _layers(t):
            p = f"blk.{il}."
            d, ff = t[p + "ffn_down.weight"].shape
            for name, n in (("attn_output", d), ("ffn_gate", ff), ("ffn_up", ff), ("ffn_down", d)):
                t[p + name + ".bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)

    src = dense_files["llama"]
    biased = rewrite(src, tmp_path / "biased.gguf", add_biases)
    assert not torch.allclose(logits(biased), logits(src), atol=1e-3)  # the biases are used
    device_matches_reference("llama", biased)


@pytest.fixture(scope="module")
def qwen3next_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.core import hybrid_export

    path = tmp_path_factory.mktemp("q3n") / "qwen3next.gguf"
    return hybrid_export.export(hybrid_export.hf_model("qwen3next"), "qwen3next", path)


def test_qwen3next_every_variant(qwen3next_file: Path, tmp_path: Path) -> None:
    a = "qwen3next"
    lm = load_model(qwen3next_file, threads=1)
    hp, n_layer = lm.hybrid, lm.spec.n_layer

    def variants(t: Tensors, m: Meta) -> None:
        fuse_qkv(t, list(hp.attn_layers))
        qkv_rows, z_rows = ssm_in_rows(hp)
        for il in hp.recurrent_layers:  # attn_qkv + attn_gate -> the legacy fused ssm_in
            qkv, z = t.pop(f"blk.{il}.attn_qkv.weight"), t.pop(f"blk.{il}.attn_gate.weight")
            fused = np.empty((qkv.shape[0] + z.shape[0], qkv.shape[1]), np.float32)
            fused[qkv_rows.numpy()], fused[z_rows.numpy()] = qkv, z
            t[f"blk.{il}.ssm_in.weight"] = fused
        last = n_layer - 1  # an MTP block after the model: a copy of the last layer, plus extras
        for k in [k for k in t if k.startswith(f"blk.{last}.")]:
            t[k.replace(f"blk.{last}.", f"blk.{n_layer}.", 1)] = t[k].copy()
        d = lm.spec.n_embd
        t[f"blk.{n_layer}.nextn.eh_proj.weight"] = np.zeros((d, 2 * d), np.float32)
        m[f"{a}.block_count"] = (n_layer + 1, GGUFValueType.UINT32)
        m[f"{a}.nextn_predict_layers"] = (1, GGUFValueType.UINT32)
        kv = [0 if r else lm.spec.n_head_kv for r in hp.recurrent] + [lm.spec.n_head_kv]
        m[f"{a}.attention.head_count_kv"] = (kv, GGUFValueType.UINT32)
        m[f"{a}.attention.head_count"] = ([lm.spec.n_head] * (n_layer + 1), GGUFValueType.UINT32)
        sh = m.pop(f"{a}.expert_shared_feed_forward_length")[0]
        m[f"{a}.feed_forward_length"] = ([sh] * (n_layer + 1), GGUFValueType.UINT32)

    path = rewrite(qwen3next_file, tmp_path / "variants.gguf", variants)
    names = GGUFFile(path).tensors
    assert "blk.0.ssm_in.weight" in names and "blk.3.attn_qkv.weight" in names
    other = load_model(path, threads=1)
    assert other.spec.n_layer == n_layer and other.hybrid.n_ff_shexp == hp.n_ff_shexp
    assert torch.equal(logits(path), logits(qwen3next_file))
    device_matches_reference(a, path)


def test_qwen3next_head_counts_that_differ_are_refused(
    qwen3next_file: Path, tmp_path: Path
) -> None:
    def edit(t: Tensors, m: Meta) -> None:
        m["qwen3next.attention.head_count_kv"] = ([2, 2, 2, 1, 2, 2, 2, 2], GGUFValueType.UINT32)

    path = rewrite(qwen3next_file, tmp_path / "bad.gguf", edit)
    with pytest.raises(GGUFError, match=r"bad\.gguf: qwen3next\.attention\.head_count_kv differs"):
        load_model(path)


@pytest.fixture(scope="module")
def qwen4exp_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.core import qwen4exp_export as q4

    root, model = tmp_path_factory.mktemp("q4x"), q4.hf_model()
    flat = q4.export(model, root / "flat.gguf")
    grouped = q4.export(model, root / "grouped.gguf", grouped_norms=True)
    return flat, grouped


def test_qwen4exp_norms_either_shape_load_identically(qwen4exp_files: tuple[Path, Path]) -> None:
    from mgserve.cuda.loader import Loader

    flat, grouped = qwen4exp_files
    gf, gg = GGUFFile(flat), GGUFFile(grouped)
    reshape_ok = re.compile(
        r"(hc_(attn|ffn)_norm|output_hc_norm|ple_norm_(key|query|conv))\.weight$"
    )
    norms = [n for n in gf.tensors if reshape_ok.search(n)]
    assert len(norms) == 1 + 2 * 8 + 3
    for n in norms:
        assert len(gf.tensors[n].shape) == 1 and len(gg.tensors[n].shape) == 2
    a, b = load_model(gf, threads=1), load_model(gg, threads=1)
    assert torch.equal(a.output_hc.norm, b.output_hc.norm) and a.output_hc.norm.shape == (4, 256)
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.hc_attn.norm, lb.hc_attn.norm)
        assert torch.equal(la.hc_ffn.norm, lb.hc_ffn.norm)
    pa, pb = a.layers[1].ple, b.layers[1].ple
    assert torch.equal(pa.norm_key, pb.norm_key) and torch.equal(pa.norm_conv, pb.norm_conv)
    la_, lb_ = Loader(gf, torch.device("cpu")), Loader(gg, torch.device("cpu"))
    for n in norms:
        va, vb = la_.vec(n, (256, 4), reshape_ok=True), lb_.vec(n, (256, 4), reshape_ok=True)
        assert va.shape == (4, 256) and torch.equal(va, vb)


def test_qwen4exp_norm_of_wrong_size_is_refused(
    qwen4exp_files: tuple[Path, Path], tmp_path: Path
) -> None:
    name = "blk.2.hc_ffn_norm.weight"

    def shrink(t: Tensors, m: Meta) -> None:
        t[name] = t[name][:-4]

    path = rewrite(qwen4exp_files[0], tmp_path / "short.gguf", shrink)
    msg = rf"short\.gguf: tensor '{name}' has shape \[1020\], expected \[256, 4\] or any shape"
    with pytest.raises(GGUFError, match=msg):
        load_model(path)
    from mgserve.cuda.backend import load_device_model, torch_backend

    with pytest.raises(GGUFError, match=msg):
        load_device_model(GGUFFile(path), torch_backend(), torch.device("cpu"), 1, 64)


def test_qwen4exp_without_output_ties_it_to_the_embedding(
    qwen4exp_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """No ``output.weight`` (llama.cpp: TENSOR_NOT_REQUIRED): the head is ``token_embd``."""

    def untie(t: Tensors, m: Meta) -> None:
        t["output.weight"] = t["token_embd.weight"].copy()

    def tie(t: Tensors, m: Meta) -> None:
        del t["output.weight"]

    separate = rewrite(qwen4exp_files[0], tmp_path / "separate.gguf", untie)
    tied = rewrite(qwen4exp_files[0], tmp_path / "tied.gguf", tie)
    assert load_model(tied, threads=1).spec.tied_output
    assert torch.equal(logits(tied), logits(separate))
    device_matches_reference("qwen4exp", tied)
