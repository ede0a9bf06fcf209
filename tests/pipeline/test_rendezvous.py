"""Where a pipeline's processes meet (pipeline/rendezvous.py): torchrun's variables or the
``--dist-*`` flags (a flag wins), one process when neither names a world, clear errors for a
world without a rank or a meeting place; what lockstep.py refuses across processes."""

from __future__ import annotations

import pytest

from mgserve.config import Settings
from mgserve.pipeline.lockstep import refuse
from mgserve.pipeline.rendezvous import Rendezvous, rendezvous

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*TORCHRUN, "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_world_is_one_process(torchrun: pytest.MonkeyPatch) -> None:
    assert rendezvous(Settings()) is None
    torchrun.setenv("WORLD_SIZE", "1")
    assert rendezvous(Settings()) is None


def test_torchrun_s_variables(torchrun: pytest.MonkeyPatch) -> None:
    for k, v in TORCHRUN.items():
        torchrun.setenv(k, v)
    assert rendezvous(Settings()) == Rendezvous(1, 3, "env://", "auto")


def test_flags_win_over_the_variables(torchrun: pytest.MonkeyPatch) -> None:
    for k, v in TORCHRUN.items():
        torchrun.setenv(k, v)
    s = Settings(dist_world_size=2, dist_rank=0, dist_init="tcp://h:1", dist_backend="gloo")
    assert rendezvous(s) == Rendezvous(0, 2, "tcp://h:1", "gloo")


def test_flags_alone(torchrun: pytest.MonkeyPatch) -> None:
    s = Settings(dist_world_size=2, dist_rank=1, dist_init="file:///tmp/x")
    assert rendezvous(s) == Rendezvous(1, 2, "file:///tmp/x", "auto")


def test_a_world_needs_a_rank_and_a_meeting_place(torchrun: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="needs this one's rank"):
        rendezvous(Settings(dist_world_size=2, dist_init="tcp://h:1"))
    with pytest.raises(ValueError, match="needs a meeting place"):
        rendezvous(Settings(dist_world_size=2, dist_rank=0))
    torchrun.setenv("WORLD_SIZE", "2")
    torchrun.setenv("RANK", "two")
    with pytest.raises(ValueError, match="RANK='two' is not a whole number"):
        rendezvous(Settings())


def test_settings_check_the_flags() -> None:
    with pytest.raises(ValueError, match="dist-init must be a URL"):
        Settings(dist_init="h:1")
    with pytest.raises(ValueError, match="dist-rank 2 is not below dist-world-size 2"):
        Settings(dist_world_size=2, dist_rank=2)
    with pytest.raises(ValueError, match="dist_backend must be one of"):
        Settings(dist_backend="mpi")


def test_what_does_not_run_across_processes_is_refused_by_name(tmp_path: object) -> None:
    refuse(Settings())
    refuse(Settings(slot_save_path=str(tmp_path)))  # a slot's parts are saved on every rank
    with pytest.raises(ValueError, match=r"processes \(--dist-\*, torchrun\): --prefill-lane on$"):
        refuse(Settings(prefill_lane="on", slot_save_path=str(tmp_path)))
    with pytest.raises(ValueError, match="--virtual-stages"):
        refuse(Settings(virtual_stages=2))
