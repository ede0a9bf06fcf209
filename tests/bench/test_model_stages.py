"""``bench model --virtual-stages N``: the bench's runner runs the model as N stages (the pools
stay the model's), and its steps give the one-stage bench's tokens (on the CPU, torch backend)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mgserve.bench.model.args import add_arguments
from mgserve.pipeline.staged import StagedLM


def _bench(path: Path, stages: int | str):
    from mgserve.bench.model.harness import ModelBench

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--model", str(path), "--device", "cpu", "--ctx", "128", "--slots", "2", "--ubatch",
         "16", "--virtual-stages", str(stages)]
    )  # fmt: skip
    return ModelBench(args)


def _tokens(bench) -> list[int]:
    toks = bench.tokens(12, 5)
    out = [bench.run_step([bench.work(1, toks, 0, True)]).results[0].token]
    for i in range(4):
        out.append(bench.run_step([bench.work(1, (out[-1],), 12 + i, True)]).results[0].token)
    return out


def test_bench_model_virtual_stages(tmp_path: Path) -> None:
    from tests.cuda.test_device_models import _export

    path = _export("qwen4exp", tmp_path)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the torch backend on a busy 2-core machine
    try:
        one, three = _bench(path, 1), _bench(path, 3)
        assert isinstance(three.runner.model, StagedLM) and len(three.runner.model.ranges) == 3
        assert not isinstance(one.runner.model, StagedLM)
        assert _tokens(three) == _tokens(one)
        both = _bench(path, "1,3")  # one model, a runner per stage count in turn
        assert not isinstance(both.runner.model, StagedLM)
        first = _tokens(both)
        both.use_stages(3)
        assert isinstance(both.runner.model, StagedLM) and _tokens(both) == first == _tokens(one)
    finally:
        torch.set_num_threads(n)


def test_stage_counts_are_checked() -> None:
    from mgserve.bench.model.harness import stage_counts

    assert stage_counts(argparse.Namespace(virtual_stages="1,3,6x3")) == [(1, 1), (3, 1), (6, 3)]
    for bad in ("0", "x", "", "3x0"):
        with pytest.raises(ValueError, match="--virtual-stages"):
            stage_counts(argparse.Namespace(virtual_stages=bad))


def test_prefill_repeat_gives_the_median_and_the_range(tmp_path: Path) -> None:
    from mgserve.bench.model import workloads
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    tps, note = workloads.time_prefill(bench, 32, 0, repeat=3)
    lo, hi = (float(x) for x in note.removeprefix("median of 3: ").split(" to "))
    assert note.startswith("median of 3: ") and 0 < lo <= tps + 0.05 and tps <= hi + 0.05  # (.1f)
    assert workloads.time_prefill(bench, 32, 0)[1] == ""
    with pytest.raises(ValueError, match="--prefill-repeat must be at least 1"):
        workloads.time_prefill(bench, 32, 0, repeat=0)


def test_paired_rounds_time_every_runner_side_by_side(tmp_path: Path) -> None:
    from mgserve.bench.model.paired import run_paired, stage_variants
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), "1,2")
    args = bench.args
    args.prefill, args.decode, args.multi_decode, args.decode_steps = "16@0", "8", "2@8", 2
    args.paired = 2
    rows: list[tuple[str, float, str]] = []
    variants = stage_variants(bench, [(1, 1), (2, 1)])
    stages: list[int] = []  # the runner current at each row (report.row's "stages" field)
    run_paired(bench, args, variants, lambda name, tps, note, **_: (
        rows.append((name, tps, note)), stages.append(bench.n_stages)))  # fmt: skip
    names = [r[0] for r in rows]
    assert names == [
        "prefill 16 tokens at depth 0 (1 virtual stages)",
        "prefill 16 tokens at depth 0 (2 virtual stages)",
        "decode, 1 session at depth 8 (1 virtual stages)",
        "decode, 1 session at depth 8 (2 virtual stages)",
        "decode, 2 sessions at depth 8, aggregate (1 virtual stages)",
        "decode, 2 sessions at depth 8, aggregate (2 virtual stages)",
    ]
    assert stages == [int(name.split("(")[-1].split()[0]) for name, _, _ in rows]
    for name, tps, note in rows:
        lo, hi = (float(x) for x in note.split(";")[0].removeprefix("median of 2: ").split(" to "))
        assert 0 < lo <= tps + 0.05 and tps <= hi + 0.05  # the note's range is printed .1f
        assert ("against 1 virtual stages in the same round" in note) == ("(2 virtual" in name)
    # both runners were kept: the same objects come back, each on its own model; the first
    # is current after the rounds
    one = bench.runner
    bench.switch(2)
    two = bench.runner
    bench.switch(1)
    assert bench.runner is one
    assert isinstance(two.model, StagedLM) and not isinstance(one.model, StagedLM)
    bench.switch(2)
    assert bench.runner is two and _tokens(bench) == (bench.switch(1) or _tokens(bench))
    with pytest.raises(ValueError, match="--paired needs two or more"):
        stage_variants(bench, [(1, 1)])


def test_paired_rounds_time_a_switch_on_and_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mgserve.bench.model import paired, workloads
    from mgserve.bench.model.paired import run_paired, toggle_variants
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    args = bench.args
    args.prefill, args.decode, args.multi_decode, args.paired = "16@0", "", "", 3
    fam = bench.ops.linear
    fam.probe = False  # type: ignore[attr-defined]  # a switch the family reads nowhere
    seen: list[bool] = []

    def scripted(b: object, n: int, depth: int) -> tuple[float, str]:
        """Rates that drift by round (100, 200, 300) and are 10% lower with the switch off; the
        first call of each variant is the untimed warm-up."""
        seen.append(fam.probe)  # type: ignore[attr-defined]
        base = 100.0 * (1 + max(0, len(seen) - 3) // 2)
        return (base if fam.probe else 0.9 * base), ""  # type: ignore[attr-defined]

    monkeypatch.setattr(workloads, "time_prefill", scripted)
    assert paired.workloads is workloads
    rows: list[tuple[str, float, str]] = []
    variants, restore = toggle_variants(bench, "linear.probe")
    run_paired(bench, args, variants,
               lambda name, tps, note, **_: rows.append((name, tps, note)))  # fmt: skip
    restore()
    # a warm-up of each, then rounds that each start one further on
    assert seen == [True, False] + [True, False, False, True, True, False]
    assert [(r[0], r[1]) for r in rows] == [
        ("prefill 16 tokens at depth 0 (linear.probe on)", 200.0),
        ("prefill 16 tokens at depth 0 (linear.probe off)", 180.0),
    ]
    assert rows[1][2].endswith(
        "against linear.probe on in the same round -10.0% (-10.0% to -10.0%)"
    )
    assert fam.probe is False  # type: ignore[attr-defined]  # put back as it was
    for bad in ("linear.nothing", "nofamily.x", "linear.matmul", "linear.probe+linear.nothing"):
        with pytest.raises(ValueError, match="not a boolean switch"):
            toggle_variants(bench, bad)
    fam.probe2 = True  # type: ignore[attr-defined]
    both, restore = toggle_variants(bench, "linear.probe+linear.probe2")  # together
    assert [label for label, _ in both] == [
        "linear.probe+linear.probe2 on",
        "linear.probe+linear.probe2 off",
    ]
    both[0][1]()
    assert fam.probe is True and fam.probe2 is True  # type: ignore[attr-defined]
    both[1][1]()
    assert fam.probe is False and fam.probe2 is False  # type: ignore[attr-defined]
    restore()
    assert fam.probe is False and fam.probe2 is True  # type: ignore[attr-defined]


def test_a_setting_is_timed_at_each_of_its_values(tmp_path: Path) -> None:
    """``--toggle family.attr=A/B``: an int setting at each value in turn, then put back; what is
    not an int or float setting, or not two different values of its type, is refused."""
    from mgserve.bench.model.paired import toggle_variants
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    fam = bench.ops.linear
    fam.probe_n = 64  # type: ignore[attr-defined]  # a setting the family reads nowhere
    fam.probe = False  # type: ignore[attr-defined]
    variants, restore = toggle_variants(bench, "linear.probe_n=128/256/64")
    assert [label for label, _ in variants] == [
        "linear.probe_n=128",
        "linear.probe_n=256",
        "linear.probe_n=64",
    ]
    seen = []
    for _, use in variants:
        use()
        seen.append(fam.probe_n)  # type: ignore[attr-defined]
    assert seen == [128, 256, 64]
    variants[1][1]()
    restore()
    assert fam.probe_n == 64  # type: ignore[attr-defined]
    bad = {
        "linear.probe_n=64": "two or more different values",
        "linear.probe_n=64/64": "two or more different values",
        "linear.probe_n=a/b": "not ints",
        "linear.probe=1/0": "not an int or float setting",
        "linear.nothing=1/2": "not an int or float setting",
    }
    for text, why in bad.items():
        with pytest.raises(ValueError, match=why):
            toggle_variants(bench, text)


def test_chunk_sizes_are_timed_side_by_side(tmp_path: Path) -> None:
    """``--toggle ubatch=A/B``: the same prompt cut into chunks of A tokens, then of B, in rounds
    (the steps the runner is given show it), then ``--ubatch`` as it was; sizes that are not two
    or more different positive integers are refused."""
    from mgserve.bench.model.paired import run_paired, toggle_variants
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    args = bench.args
    args.prefill, args.decode, args.multi_decode, args.paired = "24@0", "", "", 2
    was = args.ubatch
    chunks: list[int] = []
    step = bench.run_step

    def counted(work: list) -> object:  # type: ignore[type-arg]
        chunks.extend(len(w.tokens) for w in work)
        return step(work)

    bench.run_step = counted  # type: ignore[method-assign]
    variants, restore = toggle_variants(bench, "ubatch=8/16")
    rows: list[str] = []
    run_paired(bench, args, variants, lambda name, tps, note, **_: rows.append(name))
    restore()
    # warm-ups 8 then 16; round 0 starts at 8, round 1 at 16
    by8, by16 = [8, 8, 8], [16, 8]
    assert chunks == by8 + by16 + by8 + by16 + by16 + by8
    assert rows == [
        "prefill 24 tokens at depth 0 (ubatch 8)",
        "prefill 24 tokens at depth 0 (ubatch 16)",
    ]
    assert args.ubatch == was
    for text in ("ubatch=8", "ubatch=8/8", "ubatch=a/b", "ubatch=0/8"):
        with pytest.raises(ValueError, match="chunk sizes"):
            toggle_variants(bench, text)


def test_gc_freeze_is_a_switch_of_the_whole_heap(tmp_path: Path) -> None:
    """``--toggle gc.freeze``: the objects alive out of the collector's sight, then back in it;
    after the rounds as before them (frozen on a GPU, where warm-up freezes them as the server
    does; not on the CPU)."""
    import gc

    from mgserve.bench.model.paired import freeze_heap, toggle_variants
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    try:
        for frozen_before in (True, False):
            freeze_heap() if frozen_before else gc.unfreeze()
            variants, restore = toggle_variants(bench, "gc.freeze")
            assert [v for v, _ in variants] == ["gc.freeze on", "gc.freeze off"]
            variants[1][1]()
            assert gc.get_freeze_count() == 0
            variants[0][1]()
            assert gc.get_freeze_count() > 0
            variants[1][1]()
            restore()
            assert (gc.get_freeze_count() > 0) == frozen_before
    finally:
        gc.unfreeze()  # the other tests' heap as pytest has it


def test_moe_tiles_are_variants_of_the_grouped_kernels(tmp_path: Path) -> None:
    """``--moe-tiles A/B``: each variant sets the MoE prompt kernels' tiling (QGemmTuning) on
    the backend's qgemm; one tiling alone is not a comparison."""
    from types import SimpleNamespace

    from mgserve.bench.model.paired import tile_variants
    from mgserve.cuda.ops.qgemm import QGemmTuning

    qgemm = SimpleNamespace(grouped=None)
    bench = SimpleNamespace(ops=SimpleNamespace(linear=SimpleNamespace(qgemm=qgemm)))
    variants = tile_variants(bench, "64,128,32,2,4/256,128,16,4,2,1")  # type: ignore[arg-type]
    assert [v for v, _ in variants] == ["moe tiles 64,128,32,2,4,2", "moe tiles 256,128,16,4,2,1"]
    variants[1][1]()
    assert qgemm.grouped == QGemmTuning(256, 128, 16, 4, 2, 1)
    variants[0][1]()
    assert qgemm.grouped == QGemmTuning(bm=64)
    with pytest.raises(ValueError, match="two or more tilings"):
        tile_variants(bench, "64,128,32,2,4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="BM,BN,BK,WARPS_M,WARPS_N"):
        tile_variants(bench, "64,128/1,2")  # type: ignore[arg-type]


def test_moe_tiles_of_the_wgmma_kernels() -> None:
    """``--moe-tiles wg:A/wg:B``: the wgmma twins' MoE tiles (QGemm.grouped_wgmma), qgemm.cu's
    left as they are; the two kinds are not mixed in one run."""
    from types import SimpleNamespace

    from mgserve.bench.model.paired import tile_variants
    from mgserve.cuda.ops.wgmma import QWgmmaTuning

    qgemm = SimpleNamespace(grouped="untouched", grouped_wgmma=None)
    bench = SimpleNamespace(ops=SimpleNamespace(linear=SimpleNamespace(qgemm=qgemm)))
    tiles = "wg:128,128/wg:192,128,1/wg:128,128,2,2,1,0/wg:128,128,2,2,2,0/wg:64,128,2,3,2,1"
    variants = tile_variants(bench, tiles)  # type: ignore[arg-type]
    assert [v for v, _ in variants] == [
        "moe tiles wg:128,128,2",
        "moe tiles wg:192,128,1",
        "moe tiles wg:128,128,2,2,1,0",  # W's runs decoded by shifts and masks (SPLIT_DECODE 1)
        "moe tiles wg:128,128,2,2,2,0",  # W by 8-value runs, not half row-steps
        "moe tiles wg:64,128,2,3",  # (half row-steps: the default)
    ]
    variants[1][1]()
    assert qgemm.grouped_wgmma == QWgmmaTuning(192, 128, 1) and qgemm.grouped == "untouched"
    with pytest.raises(ValueError, match="all tilings wg:"):
        tile_variants(bench, "wg:128,128/64,128,32,2,4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not fit 2 CTAs"):
        tile_variants(bench, "wg:128,128/wg:192,128")  # type: ignore[arg-type]


def test_paired_refuses_what_it_does_not_time(tmp_path: Path) -> None:
    from mgserve.bench.model.paired import paired_report
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    args = bench.args
    args.paired, args.toggle, args.multi_prefill = 2, "", "2@16"
    with pytest.raises(ValueError, match="--multi-prefill is not timed in rounds"):
        paired_report(bench, args, [(1, 1), (2, 1)], lambda *a, **k: None, [])
    args.multi_prefill, args.toggle = "", "linear.probe"
    with pytest.raises(ValueError, match="stage counts, a --toggle or --moe-tiles, one of them"):
        paired_report(bench, args, [(1, 1), (2, 1)], lambda *a, **k: None, [])
    bench.ops.linear.probe = True  # type: ignore[attr-defined]
    args.decode = "8"  # decode graphs keep the setting they were captured under
    with pytest.raises(ValueError, match="add --no-graphs"):
        paired_report(bench, args, [(1, 1)], lambda *a, **k: None, [])


def test_paired_times_branch_decode_with_decode_graphs(tmp_path: Path) -> None:
    """``--toggle branch.decode`` with decode rows: decode graphs are captured per setting of
    the switch (cuda/graphs.py), so the bench accepts it with graphs on; on the CPU the side
    chains run inline, and both variants' rows come out, the switch put back after."""
    from mgserve.bench.model.paired import paired_report
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    args = bench.args
    args.paired, args.toggle, args.prefill, args.decode, args.multi_decode = (
        2, "branch.decode", "", "8", "",
    )  # fmt: skip
    args.decode_steps = 2
    assert not bench.ops.branch.decode  # the torch backend's: inline
    rows: list[str] = []
    paired_report(bench, args, [(1, 1)], lambda name, *a, **k: rows.append(name), [])
    assert rows == [
        "decode, 1 session at depth 8 (branch.decode on)",
        "decode, 1 session at depth 8 (branch.decode off)",
    ]
    assert not bench.ops.branch.decode


def test_bench_model_runs_on_the_cpu_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mgserve bench model --device cpu`` (the bench's own check without a GPU) prints its
    table and writes its JSON instead of asking cuda.core for a GPU; ``--gaps`` runs its three
    profiles (prompt chunk, eager step, decode steps as served), which find no GPU work."""
    import json

    from mgserve.cli import main
    from tests.cuda.test_device_models import _export

    out = tmp_path / "r.json"
    model = str(_export("qwen3", tmp_path))
    args = ["bench", "model", "--model", model, "--device", "cpu", "--ctx", "128", "--slots",
            "1", "--ubatch", "16", "--prefill", "16@0", "--decode", "0", "--decode-steps", "2",
            "--multi-decode=", "--gaps", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["gpu"] == "none (CPU)" and data["set"] == []
    assert [r["kind"] for r in data["rows"]] == ["prefill", "decode"]
    assert all(r["tokens_per_s"] > 0 for r in data["rows"])
    printed = capsys.readouterr().out
    for what in ("a 16-token prefill at depth 0", "one eager decode step at depth 0",
                 "8 decode steps of 1 session at depth 0 as served (eager)"):  # fmt: skip
        assert f"GPU idle gaps of {what}: no GPU operations in the trace" in printed
    assert main([*args, "--profile"]) == 2  # the kernels' table needs a GPU: one clear line
    assert "--profile times the GPU's kernels: it needs --device cuda" in capsys.readouterr().err


def test_set_changes_an_op_family_setting_of_its_own_type() -> None:
    """``--set family.attr=value``: parsed as the attribute's type; a missing family or
    attribute, a non-scalar one or a value of another type is refused, naming it."""
    from types import SimpleNamespace

    from mgserve.bench.model.harness import apply_setting

    fam = SimpleNamespace(packed_rows=True, prefill_piece=4096, scale=1.0, name="x")
    ops = SimpleNamespace(ple=fam, linear=SimpleNamespace(hgemm=SimpleNamespace(wgmma=False)))
    apply_setting(ops, "linear.hgemm.wgmma=on")  # a setting of a part of a family
    assert ops.linear.hgemm.wgmma is True
    apply_setting(ops, "ple.packed_rows=false")
    apply_setting(ops, "ple.prefill_piece = 1024")
    apply_setting(ops, "ple.scale=0.5")
    assert (fam.packed_rows, fam.prefill_piece, fam.scale) == (False, 1024, 0.5)
    apply_setting(ops, "ple.packed_rows=on")
    assert fam.packed_rows is True
    bad_names = ("ple.packed_rows", "nofam.x=1", "ple.nothing=1", "ple.name=y", "ple=1")
    for bad in (*bad_names, "linear.nothing.wgmma=1", "linear.hgemm=1"):
        with pytest.raises(ValueError, match="not FAMILY.ATTR=VALUE"):
            apply_setting(ops, bad)
    for bad, kind in (("ple.prefill_piece=1k", "int"), ("ple.packed_rows=yes", "bool")):
        with pytest.raises(ValueError, match=f"is not a {kind}"):
            apply_setting(ops, bad)
    assert fam.prefill_piece == 1024 and fam.packed_rows is True  # refused: nothing changed


def test_set_reaches_the_bench_backend(tmp_path: Path) -> None:
    """``bench model --set`` on the CPU bench: the backend's family has the value."""
    from mgserve.bench.model.harness import ModelBench
    from tests.cuda.test_device_models import _export

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(_export("qwen3", tmp_path)), "--device", "cpu", "--ctx",
                         "128", "--slots", "1", "--set", "ple.packed_rows=false"])  # fmt: skip
    assert ModelBench(args).ops.ple.packed_rows is False


def test_decode_rows_give_the_time_outside_the_graph_where_one_replays(tmp_path: Path) -> None:
    """A decode row's note gives the step's model graph alone (replayed back to back) and the
    served step's time outside it; on the CPU (eager steps, no graph) it says nothing."""
    from types import SimpleNamespace

    from mgserve.bench.model import workloads
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    assert workloads.gpu_alone_ms(bench, 1) is None  # EagerDecode: no replay
    assert workloads.alone_note(None, 6.2) == ""
    assert workloads.alone_note(5.64, 6.21) == "; graph alone 5.64 ms (outside it +0.57)"
    calls: list[int] = []

    def replay_ms(n: int) -> float:
        calls.append(n)
        return 14.34

    fake = SimpleNamespace(runner=SimpleNamespace(decode=SimpleNamespace(replay_ms=replay_ms)))
    assert workloads.gpu_alone_ms(fake, 5) == 14.34 and calls == [5]  # type: ignore[arg-type]


def test_host_profile_splits_a_served_step_by_function(tmp_path: Path) -> None:
    """``--host-profile``: per served decode step, the functions' calls and own time (ms), the
    runner's step among them with its callees; own times sum to no more than the step."""
    import re

    from mgserve.bench.model.host import host_profile
    from tests.cuda.test_device_models import _export

    bench = _bench(_export("qwen3", tmp_path), 1)
    lines = host_profile(bench, 8, steps=4, top=200)
    per_step = float(re.search(r"(\d+\.\d+) ms a step under it", lines[0]).group(1))  # type: ignore[union-attr]
    rows = [ln.strip("| ").split(" | ") for ln in lines[4:]]
    assert rows and all(len(r) == 4 for r in rows)
    assert sum(float(r[2]) for r in rows) <= per_step
    runner = [r for r in rows if "mgserve/cuda/runner.py" in r[0] and " _run`" in r[0]]
    assert runner and float(runner[0][1]) == 1.0, "the runner's _run: once a step"
    assert float(runner[0][3]) <= per_step
    with pytest.raises(ValueError, match="more than --ctx 128 holds"):  # _bench's ctx
        host_profile(bench, 100, steps=30)
