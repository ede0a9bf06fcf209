"""The pipeline's settings (--device-list, --tensor-split, --gpu-memory per GPU), ``mgserve info
--plan`` over several GPUs, and ``mgserve bench pipeline-model``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mgserve.cli import main
from mgserve.config import Settings, settings_from
from mgserve.devices import stage_devices, stage_memory
from tests.cuda.test_plan import _file


def test_settings_parse_and_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(device_list="0,2,1", tensor_split="3,1,1", gpu_memory="24GiB")
    assert stage_devices(s.device_list, s.gpu_memory, visible=3) == (0, 2, 1)
    assert stage_memory(s.gpu_memory, (0, 2, 1)) == [24 << 30] * 3
    assert stage_devices(None, "24GiB,16GiB", None) == (0, 1)  # a size per GPU names them
    assert stage_devices(None, "24GiB", None) == (0,)
    assert stage_devices("all", None, 4) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="CUDA shows 2 GPU"):
        stage_devices("0,3", None, 2)
    monkeypatch.setenv("MGSERVE_DEVICE_LIST", "0,1")
    monkeypatch.setenv("MGSERVE_TENSOR_SPLIT", "2,1")
    s = settings_from(None)
    assert (s.device_list, s.tensor_split) == ("0,1", "2,1")
    bad = [
        (dict(device_list="0,x"), "device-list must be CUDA ordinals"),
        (dict(device_list="1,1"), "names a GPU twice"),
        (dict(tensor_split="3,0"), "shares must be positive"),
        (dict(tensor_split="a,b", device_list="0,1"), "tensor-split must be numbers"),
        (dict(tensor_split="1,1"), "tensor-split needs --device-list"),
        (dict(tensor_split="1,1,1", dist_world_size=2), "3 shares for a pipeline of 2 processes"),
        (dict(tensor_split="1,1,1", device_list="0,1"), "3 shares for 2 GPUs"),
        (dict(gpu_memory="24GiB,8GiB,8GiB", device_list="0,1"), "3 sizes for 2 GPUs"),
        (dict(gpu_memory="24GiB,lots"), "gpu-memory must be a positive size"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            Settings(**kw)  # type: ignore[arg-type]


def _rows(out: str) -> list[list[str]]:
    """The stage rows of the printed plan: [stage, GPU, layers, ...]."""
    table = out.split("stage plan: ", 1)[1].splitlines()[2:]
    return [r.split() for r in table if re.match(r"\s+\d+\s+\d+\s+\d+-\d+", r)]


def test_info_plan_prints_the_stages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = str(_file("qwen4exp", tmp_path).path)
    args = ["info", path, "--plan", "-c", "1024", "-np", "3"]
    assert main([*args, "--device-list", "0,1,2", "--gpu-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "architecture:  qwen4exp" in out  # the file's description first
    assert "stage plan: qwen4exp, 3 GPUs, 3 slot(s) x 1,024 tokens, K f16 / V f16" in out
    head = "  stage  GPU  layers      weights  KV + state    buffers      total       free  load"
    assert head in out
    rows = _rows(out)
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.pipeline.report import plan_for

    want = plan_for(GGUFFile(path), Settings(ctx_size=1024, parallel=3, device_list="0,1,2",
                                             gpu_memory="1GiB"))  # fmt: skip
    assert [r[2] for r in rows] == [f"{a}-{b - 1}" for a, b in want.ranges]
    assert [r[:2] for r in rows] == [["0", "0"], ["1", "1"], ["2", "2"]]
    assert want.ranges[0][0] == 0 and want.ranges[-1][1] == 8
    assert all(r[-3:-1] == ["1.0", "GiB"] for r in rows)  # the free column
    assert "token embedding on GPU 0, output head and sampler on GPU 2" in out
    assert "the host gathers each token's rows for layer 1 on GPU 0" in out
    assert main([*args, "--gpu-memory", "1GiB,1GiB", "--tensor-split", "1,3"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[:3] for r in rows] == [["0", "0", "0-1"], ["1", "1", "2-7"]]
    assert main([*args, "--device-list", "4,5", "--gpu-memory", "1GiB", "-ts", "1,7"]) == 0
    assert [r[:3] for r in _rows(capsys.readouterr().out)] == [["0", "4", "0-0"], ["1", "5", "1-7"]]


def test_info_plan_refuses_stages_that_do_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = str(_file("qwen4exp", tmp_path).path)
    args = ["info", path, "--plan", "-c", "65536", "--gpu-memory", "1GiB,100"]
    assert main([*args, "--tensor-split", "1,1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mgserve: error: GPU 1 (stage 1: layers 4-7 and the output head) needs")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no split of the 8 layers over 2 GPUs fits" in err and "lower --ctx-size to" in err
    assert main(["info", path, "--plan", "--gpu-memory", "1GiB"]) == 0  # one GPU: the old plan
    assert "memory plan: qwen4exp" in capsys.readouterr().out


def test_bench_pipeline_model_predicts_the_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed's workloads (a 250k prompt, decode at 250k for 1 and 5 sessions) beside its
    figures; 2048-token chunks keep the test short."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "pipeline-model", "--chunk", "2048", "--pcie-gen", "4", "--record"]) == 0
    out = capsys.readouterr().out
    assert "assumptions (each an option of this command):" in out
    assert "936 GB/s x 0.75" in out and "lanes 8,8,4,2,4,4" in out
    assert "stage plan: qwen4exp, 6 GPUs, 5 slot(s) x 262,144 tokens, K q8_0 / V q8_0" in out
    for name, seed in (("prefill, 1 session, 250,000-token prompt", "2111.0"),
                       ("decode at 250,000, 1 session", "33.7"),
                       ("decode at 250,000, 5 sessions, per session", "27.3")):  # fmt: skip
        row = re.search(rf"\| {name} \(t/s\) \| ([\d.]+) \| {re.escape(seed)} \|", out)
        assert row and float(row.group(1)) > 0, name
    assert re.search(r"an overhead of \d+ us per layer and step gives its 1-session decode", out)
    assert "pipeline model: the seed's 6x3090" in (tmp_path / "BENCHMARKS.md").read_text()


def test_serve_refuses_what_it_cannot_do(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve names a GPU setting of a pipeline it does not run instead of ignoring it: a
    --device-list of one GPU, a split or a memory per GPU without a pipeline, a GPU not here."""
    cases = [
        (["--device-list", "1"], "--device-list 1: serve runs one GPU here"),
        (["--gpu-memory", "8GiB,8GiB", "-ts", "1,2"], "--tensor-split 1,2: serve runs one GPU"),
        (["--gpu-memory", "24GiB,24GiB"], "--gpu-memory 24GiB,24GiB: serve runs one GPU"),
        (["--device-list", "0,3"], "--device-list 0,3: GPU 3 is not among the 2 this process"),
    ]
    monkeypatch.setattr("mgserve.machine.gpu_ids", lambda: ["GPU-a", "GPU-b"])
    for extra, named in cases:
        assert main(["serve", *extra]) == 2
        err = capsys.readouterr().err
        assert f"mgserve: error: {named}" in err


def test_tensor_split_gives_each_process_of_a_pipeline_its_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Across processes (``--dist-world-size``), ``--tensor-split`` is a share per rank; without
    it the ranks split by decode weight bytes. serve refuses it in one process (one GPU)."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.pipeline.staged import balanced_ranges, process_ranges

    g = GGUFFile(_file("qwen4exp", tmp_path).path)  # 8 layers
    two = Settings(dist_world_size=2, tensor_split="1,3")
    assert process_ranges(g, two, 2, 8) == [(0, 2), (2, 8)]
    assert process_ranges(g, Settings(dist_world_size=2), 2, 8) == balanced_ranges(g, 2)
    with pytest.raises(ValueError, match="3 shares for a pipeline of 2 processes"):
        process_ranges(g, Settings(dist_world_size=3, tensor_split="1,1,1"), 2, 8)
    assert main(["serve", "-m", str(g.path), "--device", "cpu", "-ts", "1,1"]) == 2  # one process
    assert "tensor-split needs --device-list" in capsys.readouterr().err
