"""SynthFile / synth_weight (mgserve/cuda/synth_device/) on the CPU: torch stands in for the GPU.

A SynthFile must be indistinguishable from the GGUFFile of the file ``write_synth`` writes for the
same ShapeSpec (metadata values and types, tensor table, data layouts, parsed specs), and the
blocks it makes must dequantize to finite weights of a realistic magnitude.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf
from mgserve.core.gguf.hparams_qwen4exp import qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFError, GGUFFile, TensorInfo
from mgserve.core.gguf.writer import GGUFWriter
from mgserve.core.reference import ple as ple_ref
from mgserve.core.reference import ple_rows
from mgserve.core.reference.dequant import dequantize
from mgserve.core.synth.mixes import DEFAULT_MIX, MIXES, mix_of
from mgserve.core.synth.shapes import SHAPES, ShapeSpec, metadata
from mgserve.core.synth.tensors import tensor_plan
from mgserve.core.synth.vocab import SynthVocab
from mgserve.core.synth.write import write_synth
from mgserve.cuda import synth_device as sd
from mgserve.cuda.loader import Loader
from mgserve.cuda.synth_device import device as sd_device
from mgserve.cuda.synth_device import file as sd_file
from mgserve.cuda.synth_device import ple as sd_ple
from mgserve.cuda.synth_device.values import tensor_kind
from mgserve.cuda.weights import FORMATS, row_bytes

Q = GGMLQuantizationType
QWEN4EXP = "qwen4exp-flash-next"
QWEN3NEXT = "qwen3next-80b-a3b"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux-only")


def _tiny(spec: ShapeSpec) -> ShapeSpec:
    """Same structure at toy widths (as tests/core/test_synth.py): 4 layers, 4 experts."""
    tiny: dict = dict(
        n_embd=256, n_head=4, head_dim=64, n_rot=16, ssm_k_heads=2, ssm_v_heads=4,
        ssm_head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64, n_layer=4,
        vocab=SynthVocab(512, spec.vocab.pre, 400, 401, 402),
    )  # fmt: skip
    if spec.hc:
        tiny |= dict(
            hc_lowrank=32, indexer_heads=2, indexer_dim=32, indexer_top_k=8, ple_dim=64,
            ple_rows=4096, image_token_id=403, rope_sections=(3, 3, 2, 0),
        )  # fmt: skip
    return dataclasses.replace(spec, **tiny)


def _specs(g: GGUFFile) -> tuple:
    spec, hp = hybrid_spec_from_gguf(g)
    q4 = (
        qwen4exp_spec_from_gguf(g, hp.recurrent, spec.n_rot)
        if g.architecture == "qwen4exp"
        else None
    )
    return spec, hp, q4


def _assert_same_metadata(synth: sd.SynthFile, file: GGUFFile) -> None:
    assert list(synth.metadata) == list(file.metadata)
    for key, want in file.metadata.items():
        got = synth.metadata[key]
        assert type(got) is type(want), f"{key}: {type(got).__name__} != {type(want).__name__}"
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and not got.flags.writeable, key
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            assert got == want, f"{key}: {got!r} != {want!r}"


@pytest.fixture(scope="module", params=[QWEN4EXP, QWEN3NEXT])
def tiny_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(SynthFile, GGUFFile of write_synth) for a toy-width spec; every tensor has host data."""
    spec = _tiny(SHAPES[request.param])
    path = tmp_path_factory.mktemp("synth-device") / f"{request.param}.gguf"
    write_synth(spec, path, seed=5)
    return spec, sd.SynthFile(spec, seed=5), GGUFFile(path)


def test_tiny_synthfile_equals_the_written_file(tiny_pair) -> None:
    _, synth, file = tiny_pair
    assert isinstance(synth, GGUFFile) and synth.architecture == file.architecture
    _assert_same_metadata(synth, file)
    assert _specs(synth) == _specs(file)
    assert list(synth.tensors) == list(file.tensors)
    base = next(iter(file)).offset  # the file's offsets are absolute, ours data-relative
    for name, want in file.tensors.items():
        got = synth.tensor(name)
        for field in ("type_name", "type_id", "shape", "n_elements", "n_bytes"):
            assert getattr(got, field) == getattr(want, field), f"{name}.{field}"
        assert got.offset == want.offset - base, name
        assert got.data is not None, name  # toy widths: every tensor is small
        assert (got.data.dtype, got.data.shape) == (want.data.dtype, want.data.shape), name
        assert not got.data.flags.writeable, name


def test_missing_tensor_raises_like_gguffile(tiny_pair) -> None:
    _, synth, _ = tiny_pair
    with pytest.raises(GGUFError, match="synthetic.*no_such.weight"):
        synth.tensor("no_such.weight")


def test_host_values_are_sane(tiny_pair) -> None:
    _, synth, _ = tiny_pair
    for t in synth:
        v = dequantize(synth, t)  # the reference path: as Loader.vec reads them
        assert torch.isfinite(v).all(), t.name
        kind = tensor_kind(t.name)
        if "norm" in kind.replace(".", "_").split("_"):
            assert (v - 1).abs().max() < 0.25, f"{t.name}: gammas {v.min()}..{v.max()}"
        elif kind == "ssm_a":
            assert (v <= -1).all() and (v >= -16).all(), t.name
        elif kind == "ssm_dt":
            assert (v > -7.5).all() and (v < -2.0).all(), t.name
        elif kind.endswith("conv1d"):
            assert v.abs().max() <= 0.51 and v.std() > 0.1, t.name
        else:
            assert 0.015 < v.std() < 0.06 and v.abs().max() < 1, f"{t.name}: std {v.std()}"


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # as for any GGUF
def test_matrices_made_on_the_device_match_the_file_layout(
    tiny_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no host data, Loader.mat goes through synth_weight and gives the upload's layout."""
    spec, _, file = tiny_pair
    monkeypatch.setattr(sd_file, "HOST_MAX_ELEMENTS", 0)
    synth = sd.SynthFile(spec)
    cpu = torch.device("cpu")
    ld_s, ld_f = Loader(synth, cpu), Loader(file, cpu)
    made = [t for t in synth if t.data is None]
    assert len(made) > len(list(synth)) * 3 // 4
    for t in synth:
        if t.data is not None:  # the PLE table, and tensors the kernels cannot read (conv taps)
            assert t.name == "per_layer_token_embd.weight" or t.shape[0] % 8, t.name
    for t in made:
        w, ref = ld_s.mat(t.name, t.shape), ld_f.mat(t.name, t.shape)
        assert (w.type_name, w.shape, w.data.shape, w.data.dtype) == (
            ref.type_name, ref.shape, ref.data.shape, ref.data.dtype,
        ), t.name  # fmt: skip
    assert ld_s.nbytes == ld_f.nbytes


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_made_matrix_is_the_same_whatever_was_loaded_before(
    tiny_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline stage loads only its layers (models/base.py): each made matrix's bytes depend
    on its name alone, so a stage's layers are the whole model's."""
    spec, _, _ = tiny_pair
    monkeypatch.setattr(sd_file, "HOST_MAX_ELEMENTS", 0)
    synth = sd.SynthFile(spec)
    made = [t for t in synth if t.data is None]
    cpu = torch.device("cpu")
    whole, part = Loader(synth, cpu), Loader(synth, cpu)
    for t in made:
        whole.mat(t.name, t.shape)
    last = made[-1]
    a, b = whole.mat(last.name, last.shape), part.mat(last.name, last.shape)
    assert torch.equal(a.data, b.data)
    other = part.mat(made[-2].name, made[-2].shape)
    assert not torch.equal(other.data.view(-1)[:64], b.data.view(-1)[:64])  # tensors differ


@pytest.mark.parametrize("name", [QWEN4EXP, QWEN3NEXT])
def test_full_width_metadata_and_plan(name: str, tmp_path: Path) -> None:
    """Full widths, shrunk depth: the metadata a written file would hold (a tensor-less GGUF with
    the same keys; the whole file would be ~1 GB) and the plan's tensor table."""
    kw = dict(layers=4, experts=8) | (dict(ple_rows=20_000) if name == QWEN4EXP else {})
    synth = sd.SynthFile.from_shape(name, **kw)
    spec = SHAPES[name].shrink(**kw)
    path = tmp_path / "meta.gguf"
    with GGUFWriter(path, spec.arch) as w:
        for key, (value, vtype) in metadata(spec, mix_of(DEFAULT_MIX).file_type).items():
            w.add(key, value, vtype)
        w.write_header()
    file = GGUFFile(path)
    _assert_same_metadata(synth, file)
    file.tensors = synth.tensors  # the parsers read a few shapes too; only metadata may differ
    assert _specs(synth) == _specs(file)
    assert "4 layers, 8 experts" in str(synth.path) and name in str(synth.path)
    plan = tensor_plan(spec)
    assert [(t.name, t.shape, t.type_name) for t in synth] == [
        (p.name, p.shape, p.ggml_type.name) for p in plan
    ]
    for t in synth:
        big = t.n_elements > sd_file.HOST_MAX_ELEMENTS and t.name != "per_layer_token_embd.weight"
        assert (t.data is None) == big, t.name
        if big:
            assert t.type_name in FORMATS, t.name  # the device must be able to make it
            row_bytes(t.name, t.type_name, t.shape[0])


def _info(name: str, type_name: str, shape: tuple[int, ...]) -> TensorInfo:
    """A TensorInfo without host data, as SynthFile gives for a big matrix."""
    qtype = Q[type_name]
    n = int(np.prod(shape))
    nbytes = n // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    return TensorInfo(name, type_name, int(qtype), shape, n, nbytes, 0, None)  # type: ignore[arg-type]


SYNTH_TYPES = sorted(set(FORMATS) & sd.supported_types())


def _dequant(w_data: torch.Tensor, type_name: str) -> np.ndarray:
    raw = w_data.numpy()
    if type_name == "F32":
        return raw.view(np.float32)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    return quants.dequantize(raw, Q[type_name])


@pytest.mark.parametrize("type_name", SYNTH_TYPES)
def test_synth_weight_blocks_are_valid(type_name: str) -> None:
    k = 512
    t = _info("blk.0.x.weight", type_name, (k, 96, 3))
    w = sd.synth_weight(t, "cpu", seed=3)
    rb = row_bytes(t.name, type_name, k)
    assert (w.name, w.type_name, w.shape) == (t.name, type_name, t.shape)
    assert w.data.shape == (288, rb) and w.data.dtype == torch.uint8 and w.data.is_contiguous()
    v = _dequant(w.data, type_name)
    assert np.isfinite(v).all(), type_name
    assert 0.02 < v.std() < 0.045 and abs(v.mean()) < 0.005, (
        f"{type_name}: std {v.std():.4f} mean {v.mean():.5f}"
    )
    again = sd.synth_weight(t, "cpu", seed=3)
    other = sd.synth_weight(t, "cpu", seed=4)
    assert torch.equal(again.data, w.data) and not torch.equal(other.data, w.data)


def test_synth_weight_tiles_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than the pool wraps around it, block-aligned, and stays valid."""
    monkeypatch.setitem(sd_device.DEVICE_POOL_BYTES, "cpu", 34 * 100)
    sd.release_pools()
    try:
        t = _info("big", "Q8_0", (256, 50))
        w = sd.synth_weight(t, "cpu", seed=0)
        pool = sd_device._device_pools[("cpu", "Q8_0")].view(100, 34)
        blocks = w.data.reshape(-1, 34)  # [400, 34]: 4 times the pool
        start = int(torch.nonzero((pool == blocks[0]).all(dim=1))[0])
        order = (torch.arange(blocks.shape[0]) + start) % 100
        assert torch.equal(blocks, pool[order])
        assert np.isfinite(_dequant(w.data, "Q8_0")).all()
    finally:
        sd.release_pools()


def test_synth_weight_rejects_what_the_kernels_cannot_read() -> None:
    t = _info("tq1", "TQ1_0", (256, 4))
    with pytest.raises(ValueError, match="TQ1_0"):
        sd.synth_weight(t, "cpu")
    t = _info("narrow", "Q4_K", (320, 4))
    with pytest.raises(ValueError, match="320"):
        sd.synth_weight(t, "cpu")


def _ple_check(g: sd.SynthFile) -> None:
    """The table through the reference gather: finite rows of the right width, at both ends."""
    t = g.tensor("per_layer_token_embd.weight")
    _, _, q4 = _specs(g)
    ple_ref.check_table(t, q4.ple, g.path)
    n_rows = t.shape[1]
    rows = np.array([[0, 1, n_rows // 2], [n_rows - 3, n_rows - 2, n_rows - 1]])
    emb = ple_rows.gather_rows(t, rows)  # [2, 3, dim]
    assert emb.shape == (2, 3, t.shape[0]) and torch.isfinite(emb).all()
    assert 0.015 < emb.std() < 0.06
    ple_rows.advise_random(t)  # must not fail on a non-mmap table
    hashed = ple_ref.ngram_rows(np.array([5, 17, 300]), np.array([1, 2]), q4.ple)  # [3, heads]
    assert torch.isfinite(ple_rows.gather_rows(t, hashed)).all()
    with pytest.raises(ValueError):
        t.data[0, 0] = 1  # read-only, like the memory-mapped file


def test_ple_table_small_is_materialized() -> None:
    g = sd.SynthFile.from_shape(QWEN4EXP, layers=2, experts=1, ple_rows=50_000)
    t = g.tensor("per_layer_token_embd.weight")
    assert t.type_name == "Q5_0"  # 160 wide: Q4_K_M's Q4_K falls back
    assert t.shape == (160, 50_000) and t.data.shape == (50_000, 110)
    assert t.data.dtype == np.uint8 and t.data.base is None
    _ple_check(g)


@linux_only
def test_ple_table_mapped_equals_materialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the materialise limit the table is one memfd pool mapped back to back: same bytes
    as the materialised table for the same seed."""
    monkeypatch.setattr(sd_ple, "PLE_TILE_BYTES", 1 << 20)
    kw = dict(layers=2, experts=1, ple_rows=30_000, seed=7)
    dense = sd.SynthFile.from_shape(QWEN4EXP, **kw)
    monkeypatch.setattr(sd_ple, "PLE_MATERIALIZE_BYTES", 0)
    mapped = sd.SynthFile.from_shape(QWEN4EXP, **kw)
    a = dense.tensor("per_layer_token_embd.weight").data
    b = mapped.tensor("per_layer_token_embd.weight").data
    assert isinstance(b.base, sd_ple.TiledMapping)
    np.testing.assert_array_equal(a, b)
    _ple_check(mapped)


@linux_only
def test_full_size_ple_table_costs_one_tile() -> None:
    """The real ~320M-row table (~35 GB at Q5_0) as a mapping: cheap, and every row readable."""
    g = sd.SynthFile.from_shape(QWEN4EXP, layers=2, experts=1)
    t = g.tensor("per_layer_token_embd.weight")
    assert t.shape[1] > 320_000_000 and t.data.shape == (t.shape[1], 110)
    assert isinstance(t.data.base, sd_ple.TiledMapping)
    _ple_check(g)


def test_from_shape_validates() -> None:
    with pytest.raises(ValueError, match="unknown synthetic shape"):
        sd.SynthFile.from_shape("nope")
    with pytest.raises(ValueError, match="--experts"):
        sd.SynthFile.from_shape(QWEN3NEXT, experts=0)
    with pytest.raises(ValueError, match="PLE"):
        sd.SynthFile.from_shape(QWEN3NEXT, ple_rows=10_000)


@pytest.mark.gpu
def test_synth_weight_on_the_gpu_is_fast_and_valid() -> None:
    """~6 GB of expert-sized matrices on the GPU: time it (a 35 GB model must take well under a
    minute) and check a slice of each dequantizes to finite weights of the usual magnitude."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda", 0)
    shapes = {"Q4_K": (2560, 640, 256), "Q5_0": (640, 2560, 256), "Q8_0": (640, 2560, 256)}
    for type_name, shape in shapes.items():  # pools and kernels warm
        sd.synth_weight(_info("warm", type_name, shape[:2]), dev)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    made = [sd.synth_weight(_info(f"w{i}", tn, s), dev, seed=i) for i, (tn, s) in
            enumerate(list(shapes.items()) * 4)]  # fmt: skip
    t1.record()
    torch.cuda.synchronize()
    seconds = t0.elapsed_time(t1) / 1e3
    total = sum(w.nbytes for w in made)
    print(
        f"synth_weight: {total / 1e9:.2f} GB in {seconds:.3f} s = {total / 1e9 / seconds:.0f} GB/s"
    )
    assert total / seconds > 200e9, f"{total / 1e9 / seconds:.0f} GB/s"
    for w in made[:3]:
        v = _dequant(w.data[:4096].cpu(), w.type_name)
        assert np.isfinite(v).all() and 0.02 < v.std() < 0.045, f"{w.type_name}: std {v.std()}"
    del made
    sd.release_pools()


@pytest.mark.parametrize("name", [QWEN4EXP, QWEN3NEXT])
@pytest.mark.usefixtures("stable_qsa_ties")
def test_synth_file_in_the_converter_layout_runs_on_both_paths(name: str, tmp_path: Path) -> None:
    """``mgserve synth`` and the device synthetic model write the converter's layout (1-D
    hyper-connection / PLE norms); the device model (torch backend) on the written file matches
    the reference model on it. (PLE rows of 16 heads x 16 = n_embd, as llama.cpp's ple_key asks.)"""
    from mgserve.cuda.backend import torch_backend
    from tests.cuda.test_device_models import TOL_TORCH, _compare

    spec = _tiny(SHAPES[name])
    if spec.hc:
        spec = dataclasses.replace(spec, ple_dim=16)
    path = write_synth(spec, tmp_path / f"{name}.gguf", seed=5).path
    synth, file = sd.SynthFile(spec, seed=5), GGUFFile(path)
    if spec.hc:
        width = (spec.hc * spec.n_embd,)
        for t in (
            "output_hc_norm.weight",
            "blk.0.hc_attn_norm.weight",
            "blk.1.ple_norm_key.weight",
        ):
            assert synth.tensors[t].shape == file.tensors[t].shape == width, t
    torch.manual_seed(0)
    _compare(spec.arch, path, torch_backend(), torch.device("cpu"), TOL_TORCH)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("name", [QWEN4EXP, QWEN3NEXT])
def test_every_type_of_a_mix_can_be_made(name: str, mix: str) -> None:
    """The device synth has a generator for every type a mix gives a full-width model, and the
    CUDA kernels read every large one."""
    plan = tensor_plan(SHAPES[name], mix)
    assert {p.ggml_type.name for p in plan} <= sd.supported_types()
    for p in plan:
        if np.prod(p.shape) > sd_file.HOST_MAX_ELEMENTS and p.name != "per_layer_token_embd.weight":
            row_bytes(p.name, p.ggml_type.name, p.shape[0])
