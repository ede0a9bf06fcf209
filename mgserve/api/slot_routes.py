"""llama-server's slot actions: ``POST /slots/{id_slot}?action=save|restore|erase`` with
``--slot-save-path`` (core/engine/slot_store.py does the work). Answers carry llama-server's
fields; its refusals too (501 without a save path; 400 for a bad slot id, action or file name, and
for a file that cannot be restored here, with the reason). A busy slot is not refused: the action
waits for its request to end, as llama-server defers it.
"""

from __future__ import annotations

from aiohttp import web

from mgserve.api import fields
from mgserve.api.errors import ApiError
from mgserve.api.http import SERVICE, json_response, read_body
from mgserve.core.engine.slot_store import SlotFileDone, SlotStore

ACTIONS = ("save", "restore", "erase")


async def slot_action(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    store = service.slot_store
    if store is None:
        raise ApiError(
            "This server does not support slots action. Start it with `--slot-save-path`", 501
        )
    try:
        id_slot = int(request.match_info["id_slot"])
    except ValueError:
        raise ApiError("Invalid slot ID: an integer is expected", param="id_slot") from None
    if not 0 <= id_slot < service.engine.n_slots:
        n = service.engine.n_slots
        raise ApiError(f"Invalid slot ID: {id_slot} (the server has {n} slots)", param="id_slot")
    action = request.query.get("action")
    if action not in ACTIONS:
        raise ApiError(f"Invalid action {action!r}: one of {ACTIONS} is expected", param="action")
    if action == "erase":
        if await request.read():
            await read_body(request, frozenset())  # erase takes no fields
        return json_response({"id_slot": id_slot, "n_erased": await store.erase(id_slot)})
    filename = _filename(store, await read_body(request, fields.SLOT_FILE))
    if action == "save":
        try:
            done = await store.save(id_slot, filename)
        except OSError as e:
            raise ApiError(f"could not write {filename}: {e.strerror}", 500, "filename") from None
        return _answer(id_slot, filename, done, "saved", "written", "save_ms")
    try:
        done = await store.restore(id_slot, filename)
    except (ValueError, OSError) as e:
        raise ApiError(f"Unable to restore slot {id_slot}: {e}", param="filename") from None
    return _answer(id_slot, filename, done, "restored", "read", "restore_ms")


def _answer(
    id_slot: int, filename: str, done: SlotFileDone, tokens: str, nbytes: str, ms: str
) -> web.Response:
    """llama-server's answer: n_saved / n_written / save_ms, or their restore names."""
    return json_response(
        {
            "id_slot": id_slot,
            "filename": filename,
            f"n_{tokens}": done.n_tokens,
            f"n_{nbytes}": done.n_bytes,
            "timings": {ms: done.ms},
        }
    )


def _filename(store: SlotStore, body: dict[str, object]) -> str:
    name = body.get("filename")
    if not isinstance(name, str):
        raise ApiError(
            "'filename' is required: a file name in the slot save path", param="filename"
        )
    try:
        store.path(name)
    except ValueError as e:
        raise ApiError(f"Invalid filename: {e}", param="filename") from None
    return name


ROUTES = [web.post("/slots/{id_slot}", slot_action)]
