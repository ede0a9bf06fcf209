"""Recurrent-state checkpoints in the scheduler, with fake step results: where prompts are cut and
checkpointed, which slot and checkpoint a request reuses, what is dropped when a slot's history
changes, the device / host policy, and that a runner's store always holds what the book counts.
"""

from __future__ import annotations

import pytest

from mgserve.core.engine.checkpoints import CheckpointBook, CheckpointStore
from mgserve.core.engine.contract import CheckpointMove, ScheduledBatch
from mgserve.core.engine.scheduler import Scheduler
from tests.core.test_scheduler import answer, req


class Recorder:
    """A fake runner: applies each batch to a CheckpointStore whose checkpoints are their tier."""

    def __init__(self) -> None:
        self.restored: list[tuple[int, str]] = []  # (slot, tier) per restore
        self.store: CheckpointStore[str] = CheckpointStore(
            lambda slot: "device", lambda slot, c: self.restored.append((slot, c)), lambda c: "host"
        )

    def run(self, s: Scheduler) -> ScheduledBatch:
        b = s.schedule()
        assert b is not None
        self.store.before(b)
        self.store.after(b)
        s.apply(answer(b))
        held = {k: v == "host" for k, v in self.store.held.items()}
        assert held == s.checkpoints.held  # the runner holds exactly what the book counts
        return b


def sched(n_slots: int = 1, every: int = 8, per_slot: int = 8, host: int = 0) -> Scheduler:
    book = CheckpointBook(every, per_slot, host_bytes=host, nbytes=10)
    return Scheduler(n_slots, n_ctx=256, batch_size=16, rewindable=False, checkpoints=book)


def run_all(s: Scheduler, r: Recorder) -> list[ScheduledBatch]:
    out = []
    while s.has_work():
        out.append(r.run(s))
    return out


def chunks(batches: list[ScheduledBatch]) -> list[tuple[int, int, bool, bool]]:
    """(start, end, checkpoint, restore) of every work, decode steps included."""
    return [
        (w.start, w.start + len(w.tokens), w.checkpoint, w.restore) for b in batches for w in b.work
    ]


def test_prompt_chunks_end_and_checkpoint_on_multiples_of_every() -> None:
    s, r = sched(), Recorder()
    s.add(req("a", list(range(1, 21)), max_tokens=2))  # 20 tokens; batch_size 16, every 8
    assert chunks(run_all(s, r)) == [
        (0, 8, True, False),
        (8, 16, True, False),
        (16, 20, False, False),  # the prompt's end samples
        (20, 21, False, False),  # decode
    ]
    assert sorted(s.checkpoints.held) == [(0, 8), (0, 16)]


def test_without_periodic_checkpoints_the_last_chunk_end_before_the_prompt_end_is_kept() -> None:
    s, r = sched(every=0), Recorder()
    s.add(req("a", list(range(1, 41)), max_tokens=1))
    got = chunks(run_all(s, r))
    assert got == [(0, 16, False, False), (16, 32, True, False), (32, 40, False, False)]
    assert list(s.checkpoints.held) == [(0, 32)]


def test_a_shorter_shared_prefix_restores_the_nearest_checkpoint_and_drops_later_ones() -> None:
    s, r = sched(), Recorder()
    a = list(range(1, 21))
    s.add(req("a", a, max_tokens=3))
    run_all(s, r)
    s.add(req("b", a[:13] + [99, 98]))  # shares 13 tokens: the checkpoint at 8 serves
    b = r.run(s)
    (w,) = b.work
    assert (w.start, w.restore, w.new_sequence) == (8, True, True)
    assert w.history == tuple(a[:8])
    assert b.checkpoint_moves == (CheckpointMove(0, 16, False),)
    assert r.restored == [(0, "device")]
    s.abort("b")
    assert s.slots[0].cached[:8] == a[:8]


def test_an_edited_turn_restores_the_previous_prompt_end() -> None:
    s, r = sched(every=0), Recorder()
    turn1 = list(range(1, 21))  # 20 tokens: checkpoint at 16
    s.add(req("a", turn1, max_tokens=4))
    run_all(s, r)
    edited = turn1 + [50, 51, 52]  # the answer (7 7 7 7) replaced
    s.add(req("b", edited, max_tokens=1))
    assert chunks(run_all(s, r)) == [(16, 23, False, True)]


def test_the_whole_history_still_needs_no_restore() -> None:
    s, r = sched(), Recorder()
    s.add(req("a", list(range(1, 11)), max_tokens=2))  # history: 10 prompt + 1 fed token
    run_all(s, r)
    s.add(req("b", [*range(1, 11), 7, 7, 5]))
    (w,) = r.run(s).work
    assert (w.start, w.restore) == (11, False)


def test_the_slot_with_the_best_checkpoint_wins() -> None:
    s, r = sched(n_slots=2), Recorder()
    x = list(range(1, 21))
    s.add(req("a", x[:7] + [90] * 13, max_tokens=1))  # shares 7 with y: no checkpoint within
    s.add(req("b", x[:18] + [91, 92], max_tokens=1))  # shares 18 with y: checkpoint at 16
    run_all(s, r)
    y = x[:19] + [93]
    s.add(req("c", y, max_tokens=1))
    (w,) = r.run(s).work
    slot_b = next(sl.id for sl in s.slots if sl.cached[:18] == x[:18])
    assert (w.slot, w.start, w.restore) == (slot_b, 16, True)


def test_a_failed_step_forgets_the_slot_checkpoints() -> None:
    s, r = sched(), Recorder()
    s.add(req("a", list(range(1, 21)), max_tokens=1))
    b1 = r.run(s)  # checkpoint at 8 taken
    b2 = s.schedule()
    assert b2 is not None and b2.work[0].checkpoint  # would take 16: the step fails instead
    s.fail(b2.step, "boom")
    assert s.checkpoints.held == {}
    s.add(req("b", [5, 6, 7]))
    b3 = s.schedule()
    assert b3 is not None and set(b3.checkpoint_moves) == {
        CheckpointMove(0, 8, False),
        CheckpointMove(0, 16, False),
    }
    r.store.before(b3)  # dropping one never taken is fine
    assert r.store.held == {}
    assert b1.work[0].checkpoint


def test_the_least_recently_used_moves_to_host_then_is_dropped() -> None:
    book = CheckpointBook(every=0, per_slot=2, host_bytes=25, nbytes=10)  # 2 on host at most
    for pos in (1, 2, 3):
        book.add(0, pos)
    assert book.held == {(0, 1): True, (0, 2): False, (0, 3): False}
    book.keep(0, 2)  # drops 3; the one at 2 becomes the most recently used
    book.add(0, 4)  # device: 2, 4
    book.add(1, 9)
    book.add(0, 5)  # device of slot 0 full again: 2 (used before 4) goes to host
    assert book.held == {(0, 1): True, (0, 2): True, (0, 4): False, (0, 5): False, (1, 9): False}
    book.add(0, 6)  # 4 to host: over the budget, the oldest on host (1) is dropped
    assert book.held == {(0, 2): True, (0, 4): True, (0, 5): False, (0, 6): False, (1, 9): False}
    assert (book.nbytes_in(host=True), book.nbytes_in(host=False)) == (20, 30)
    assert CheckpointMove(0, 1, False) in book.take_moves()
    assert book.take_moves() == ()


def test_without_host_memory_the_victim_is_dropped() -> None:
    book = CheckpointBook(every=0, per_slot=1, host_bytes=0, nbytes=10)
    book.add(0, 1)
    book.add(0, 2)
    assert book.held == {(0, 2): False}
    assert book.take_moves() == (CheckpointMove(0, 1, False),)


def test_chunk_ends_are_absolute_multiples() -> None:
    every8 = CheckpointBook(every=8, per_slot=1, host_bytes=0, nbytes=1)
    assert [every8.chunk_end(d, 20, 16) for d in (0, 5, 8, 16)] == [
        (8, True),
        (8, True),
        (16, True),
        (20, False),
    ]
    ends = CheckpointBook(every=0, per_slot=1, host_bytes=0, nbytes=1)
    assert [ends.chunk_end(d, 40, 16) for d in (0, 5, 16, 32)] == [
        (16, False),
        (16, False),
        (32, True),
        (40, False),
    ]
    assert CheckpointBook.off().chunk_end(5, 40, 16) == (21, False)  # from where it starts
    with pytest.raises(ValueError, match="bad checkpoint sizes"):
        CheckpointBook(every=-1, per_slot=1, host_bytes=0, nbytes=1)


def test_a_rewindable_model_takes_no_checkpoints() -> None:
    book = CheckpointBook(every=8, per_slot=8, host_bytes=0, nbytes=10)
    s = Scheduler(1, n_ctx=256, batch_size=16, rewindable=True, checkpoints=book)
    s.add(req("a", list(range(1, 21)), max_tokens=1))
    b = s.schedule()
    assert b is not None and b.work[0].tokens == tuple(range(1, 17)) and not b.work[0].checkpoint


def test_checkpoint_settings_take_llama_server_flags_and_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from mgserve.config import Settings, add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("MGSERVE_CACHE_RAM", "64")
    s = settings_from(parser.parse_args(["-cpent", "4096", "-ctxcp", "2"]))
    assert (s.checkpoint_every, s.ctx_checkpoints, s.cache_ram) == (4096, 2, 64)
    for bad, field in (({"cache_ram": -1}, "cache-ram"), ({"ctx_checkpoints": -1}, "ctx-ch")):
        with pytest.raises(ValueError, match=field):
            Settings(**bad)  # type: ignore[arg-type]


def test_slot_info_shows_progress_and_the_checkpoints_held() -> None:
    s, r = sched(per_slot=1, host=100), Recorder()
    s.add(req("a", list(range(1, 21)), max_tokens=2))  # chunks end at 8, 16, 20 (every 8)
    r.run(s)
    (info,) = s.slot_info()
    assert (info["state"], info["n_prompt_tokens_processed"], info["n_past"]) == (
        "prefilling",
        8,
        8,
    )
    assert info["checkpoints"] == [{"pos": 8, "memory": "device"}]
    r.run(s)  # a checkpoint at 16; the one at 8 moves to host memory (one per slot on the device)
    (info,) = s.slot_info()
    assert info["checkpoints"] == [{"pos": 8, "memory": "host"}, {"pos": 16, "memory": "device"}]
    r.run(s)  # the last chunk samples the first token
    (info,) = s.slot_info()
    assert info["state"] == "generating"
    assert info["next_token"] == [{"has_next_token": True, "n_remain": 1, "n_decoded": 1}]
    run_all(s, r)
    (info,) = s.slot_info()
    assert (info["state"], info["is_processing"], info["n_past"]) == ("idle", False, 21)
    assert "params" not in info and len(info["checkpoints"]) == 2  # kept for a later request


def test_cut_hints_end_chunks_and_take_checkpoints() -> None:
    s, r = sched(every=0), Recorder()
    # 11 inside the prompt; 16 is a chunk end anyway, 0 and 40 are not inside it
    s.add(req("a", list(range(1, 41)), max_tokens=1, cut_hints=(40, 11, 16, 0)))
    assert s.queue[0][0].cut_hints == (11,)
    got = chunks(run_all(s, r))
    assert got == [(0, 11, True, False), (11, 16, False, False), (16, 32, True, False),
                   (32, 40, False, False)]  # fmt: skip
    assert sorted(s.checkpoints.held) == [(0, 11), (0, 32)]


def test_a_state_is_reused_only_before_the_first_hint_the_requests_differ_on() -> None:
    s, r = sched(every=0), Recorder()
    a = list(range(1, 41))
    s.add(req("a", a, max_tokens=1, cut_hints=(11,)))
    run_all(s, r)
    s.add(req("b", a[:36] + [99, 98], max_tokens=1, cut_hints=(11,)))  # the same cut: 32
    assert chunks(run_all(s, r))[0] == (32, 38, False, True)
    s.add(req("c", a[:36] + [97, 96], max_tokens=1, cut_hints=(11,)))
    run_all(s, r)
    s.add(req("d", a[:36] + [95, 94], max_tokens=1))  # no cut at 11: 11 and 32 were shaped by it
    assert chunks(run_all(s, r))[0] == (0, 16, False, False)
    s.add(req("e", a[:36] + [93], max_tokens=1, cut_hints=(12,)))  # only below 12 agrees: none
    assert chunks(run_all(s, r))[0] == (0, 12, True, False)
    assert s.slots[0].cuts == (12,)
