"""``mgserve serve`` as a layer pipeline of two processes on the CPU (gloo), started as torchrun
starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): rank 0 serves HTTP,
rank 1 follows its steps. Concurrent greedy requests (sharing steps, with n-gram drafts: a
recurrent model's verify rolls back on every rank) get the tokens a one-process ``DeviceRunner``
gives each prompt alone; SIGTERM to rank 0 ends both with status 0. A dense model (llama) and
qwen4exp (its hyper-connection streams cross between the processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.api.serve_process import ROOT, free_port
from tests.prom import metric

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
pytestmark = pytest.mark.slow

DATA = ROOT / "tests" / "data"
N_PREDICT, N_CTX, SLOTS = 12, 128, 3
PROMPTS = [[5, 17, 42, 99, 7], [11, 3, 250, 64, 8, 19, 33], [100, 101, 102, 100, 101, 102, 100]]
SERVE = ["serve", "--device", "cpu", "-c", str(N_CTX), "-np", str(SLOTS), "-t", "1",
         "--spec-max-users", "4", "--spec-ngram-min", "1", "--log-level", "info"]  # fmt: skip


def _ranks(model: Path, tmp: Path, port: int) -> list[subprocess.Popen[bytes]]:
    master = free_port()
    code = "import sys; from mgserve.cli import main; sys.exit(main(sys.argv[1:]))"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    procs = []
    for rank in (0, 1):
        env = os.environ | {
            "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master),
        }  # fmt: skip
        args = [sys.executable, "-c", code, *SERVE, "-m", str(model), "--port", str(port)]
        with open(tmp / f"rank{rank}.log", "ab") as out:
            procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env))
    return procs


def serve_here(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``mgserve <args> --port P --dist-world-size 2`` as one command, which starts rank 1 itself
    (pipeline/launch.py), its output in ``log``: the process and its base URL."""
    code = "import sys; from mgserve.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env |= {
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    }
    port = free_port()
    with open(log, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-c", code, *args, "--port", str(port), "--dist-world-size", "2"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    return p, f"http://127.0.0.1:{port}"


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- rank {r}\n" + (tmp / f"rank{r}.log").read_text() for r in (0, 1))


def _wait_ready(base: str, procs: list[subprocess.Popen[bytes]], tmp: Path) -> None:
    end = time.monotonic() + 60
    while True:
        assert all(p.poll() is None for p in procs), _logs(tmp)
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        assert time.monotonic() < end, "rank 0 did not come up:\n" + _logs(tmp)
        time.sleep(0.3)


def _post(base: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        base + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _complete(base: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False}  # fmt: skip
    return list(_post(base, body)["tokens"])  # type: ignore[call-overload]


def _one_process(model: Path) -> list[list[int]]:
    """Each prompt alone through a one-process DeviceRunner: its greedy tokens."""
    from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    cpu = torch.device("cpu")
    runner = DeviceRunner(
        load_device_model(GGUFFile(model), torch_backend(), cpu, 1, N_CTX), cpu, graphs=False
    )
    greedy, out = SamplingParams(temperature=0.0), []
    for i, prompt in enumerate(PROMPTS):
        work = SeqWork(0, f"r{i}", tuple(prompt), 0, True, greedy, new_sequence=True)
        tokens, pos = [], len(prompt)
        for step in range(N_PREDICT):
            tokens.append(runner.run(ScheduledBatch(100 * i + step, (work,))).results[0].token)
            work = SeqWork(0, f"r{i}", (tokens[-1],), pos, True, greedy)
            pos += 1
        out.append(tokens)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen4exp"])
def test_two_processes_serve_the_one_process_tokens(arch: str, tmp_path: Path) -> None:
    model = DATA / f"converted_{arch}.gguf"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = _ranks(model, tmp_path, port)
    try:
        _wait_ready(base, procs, tmp_path)
        with ThreadPoolExecutor(len(PROMPTS)) as ex:  # in flight together: shared steps
            got = list(ex.map(lambda p: _complete(base, p), PROMPTS))
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            want = _one_process(model)
        finally:
            torch.set_num_threads(n)
        assert got == want, _logs(tmp_path)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        drafts = metric(text, "mgserve_spec_draft_proposed_total")
        assert drafts, "no step carried drafts: the verify path across processes was not run"
        _check_stage_figures(base)
        # a grammar stays on rank 0 (its matcher cannot cross); the step runs on both ranks
        body = {
            "prompt": [5, 6, 7],
            "n_predict": 4,
            "temperature": 0,
            "json_schema": {"type": "object"},
        }
        assert _post(base, body)["content"].startswith("{")
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
        assert codes == [0, 0], _logs(tmp_path)
        follower = (tmp_path / "rank1.log").read_text()
        assert "rank 0 stopped after" in follower and "failed" not in follower, follower
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _check_stage_figures(base: str) -> None:
    """/metrics on rank 0 has both ranks' stages (pipeline/stage_stats.py): each busy, rank 1's
    stage waiting for rank 0's hand-offs, the bytes rank 0 sent, and a span to be busy in."""
    end = time.monotonic() + 10
    while True:  # rank 1's figures come after its steps, when it goes idle
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        busy = [metric(text, "mgserve_pipeline_stage_busy_seconds_total", stage=s) or 0.0
                for s in ("0", "1")]  # fmt: skip
        if busy[1] > 0 or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert all(b > 0 for b in busy), text
    fractions = [metric(text, "mgserve_pipeline_stage_busy_fraction", stage=s) for s in "01"]
    assert all(f is not None and 0 < f <= 1 for f in fractions), fractions
    assert (metric(text, "mgserve_pipeline_stage_wait_seconds_total", stage="1") or 0) > 0
    assert (metric(text, "mgserve_pipeline_link_bytes_total", link="0-1") or 0) > 0
    overlap = metric(text, "mgserve_pipeline_overlap")
    assert overlap is not None and 0 < overlap <= 2, overlap
    assert (metric(text, "mgserve_pipeline_steps_total") or 0) > N_PREDICT


def test_a_follower_whose_rank_0_dies_exits_with_an_error(tmp_path: Path) -> None:
    port = free_port()
    procs = _ranks(DATA / "converted_llama.gguf", tmp_path, port)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", procs, tmp_path)
        procs[0].kill()
        assert procs[1].wait(timeout=30) == 1, _logs(tmp_path)
        assert "rank 0 is gone" in (tmp_path / "rank1.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_rank_0_whose_follower_dies_exits_with_an_error(tmp_path: Path) -> None:
    """A follower gone, rank 0's next step cannot cross: it exits 1 rather than serve on with
    every request failing (or with the ranks' hand-offs out of step)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs = _ranks(DATA / "converted_llama.gguf", tmp_path, port)
    try:
        _wait_ready(base, procs, tmp_path)
        procs[1].kill()
        procs[1].wait(timeout=30)
        with pytest.raises((urllib.error.URLError, ConnectionError, TimeoutError)):
            _complete(base, PROMPTS[0])
        assert procs[0].wait(timeout=30) == 1, _logs(tmp_path)
        assert "the pipeline cannot go on" in (tmp_path / "rank0.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_world_without_a_meeting_place_is_refused(tmp_path: Path) -> None:
    code = "import sys; from mgserve.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    args = [*SERVE, "-m", str(DATA / "converted_llama.gguf"), "--dist-world-size", "2",
            "--dist-rank", "1"]  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       timeout=60, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2
    assert b"needs a meeting place: --dist-init" in r.stderr


def test_one_command_serves_a_pipeline_of_this_hosts_processes(tmp_path: Path) -> None:
    """``serve --dist-world-size 2`` with no rank and no meeting place starts rank 1 itself
    (pipeline/launch.py; on GPUs ``--device-list 0,1`` does so with a GPU each): the tokens of
    one process; a rank that dies ends rank 0 with 1; SIGTERM ends both with 0."""
    model = DATA / "converted_llama.gguf"

    def start(log: str) -> tuple[subprocess.Popen[bytes], str]:
        return serve_here([*SERVE, "-m", str(model)], tmp_path / log)

    def children(p: subprocess.Popen[bytes]) -> list[int]:
        text = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text()
        return [int(x) for x in text.split()]

    p, base = start("rank0.log")
    try:
        _wait_ready(base, [p], tmp_path)
        assert len(children(p)) == 1
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = list(ex.map(lambda q: _complete(base, q), PROMPTS))
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert got == _one_process(model)
        finally:
            torch.set_num_threads(n)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, (tmp_path / "rank0.log").read_text()
        log = (tmp_path / "rank0.log").read_text()
        assert "rank 1 mgserve.pipeline.lockstep: rank 1: rank 0 stopped after" in log, log
        p, base = start("again.log")
        _wait_ready(base, [p], tmp_path)
        os.kill(children(p)[0], signal.SIGKILL)  # a stage gone: rank 0 cannot serve on
        assert p.wait(timeout=30) == 1
        assert "the pipeline cannot go on" in (tmp_path / "again.log").read_text()
        p, base = start("killed.log")
        _wait_ready(base, [p], tmp_path)
        child = children(p)[0]
        p.kill()  # rank 0 gone at once: its children end (their connections close; the kernel
        # kills them too: launch._die_with_parent, for a rank blocked where no socket tells it)
        p.wait(timeout=30)
        end = time.monotonic() + 20
        while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
            assert time.monotonic() < end, f"rank 1 (pid {child}) outlived rank 0"
            time.sleep(0.2)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _state(pid: int) -> str:
    """The process's state letter (Z: a zombie, dead but not reaped), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
