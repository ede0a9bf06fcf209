"""A conversation across a restart, for the slot save tests of every runner: a first turn, the
slot saved; then, on the old engine, the second turn (the unsaved slot continued), and on a new
engine (a reloaded model) the saved slot restored, the same second turn, and after a second
restore an edited turn (the first answer replaced), which starts from the checkpoint the file
carried (a KV cache: from the common prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mgserve.core.engine.actor import Engine
from mgserve.core.engine.slot_store import SlotStore
from tests.core.checkpoint_turns import EDITED, SYSTEM, USER1, USER2, Answer, ask

P1 = SYSTEM + USER1
EDITED_CACHED = {True: 180, False: 160}  # by rewindable: the common prefix, the checkpoint at 160


class Turns(NamedTuple):
    n_held: int  # tokens the saved slot held
    n_saved: int
    n_restored: int
    live: Answer  # the second turn on the unsaved slot
    restored: Answer  # the second turn after the restart and restore
    edited: Answer  # the edited turn after another restore
    p2: list[int]
    p3: list[int]


async def restart_turns(
    new_engine: Callable[[], Engine], store: Callable[[Engine], SlotStore]
) -> Turns:
    """``new_engine()``: an engine on a freshly loaded model; ``store(engine)``: its slot files
    (one directory for both)."""
    engine = new_engine()
    await engine.start()
    try:
        a1 = await ask(engine, "t1", P1)
        saved = await store(engine).save(0, "conv.bin")
        p2 = P1 + a1.tokens + USER2
        live = await ask(engine, "t2", p2)
    finally:
        await engine.stop()
    engine = new_engine()
    files = store(engine)
    await engine.start()
    try:
        restored = await files.restore(0, "conv.bin")
        again = await ask(engine, "t2", p2)
        await files.restore(0, "conv.bin")
        p3 = P1 + EDITED + USER2
        edited = await ask(engine, "t3", p3)
    finally:
        await engine.stop()
    n_held = len(P1) + len(a1.tokens) - 1  # the last answer token never went through the model
    return Turns(n_held, saved.n_tokens, restored.n_tokens, live, again, edited, p2, p3)
