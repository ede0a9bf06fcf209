"""Recurrent-state checkpoints of a device slot (core/engine/checkpoints.py says what they are
for and who decides which exist).

A checkpoint packs what a slot holds that is not positional (``SlotPools.recurrent``: DeltaNet
conv and recurrent states, QSA pending keys, the PLE conv history) into one flat float32 tensor,
with the model's host-side state of the slot beside it (qwen4exp: the PLE token history). Every
copy is queued on the current stream, none waits for the device: a checkpoint is taken after a
prompt step's forward, a move to host memory is one copy into pinned memory, and a restore (one
copy back from there, then a scatter into the pools) runs before the step that continues from it.

A slot save (``save_slot``) copies to host memory the slot's K/V rows and QSA block keys of its
tokens, its live recurrent state and its checkpoints, each packed as a checkpoint is, on a stream
of its own (save_stream.py: decoders keep going meanwhile); a load checks all of them against the
slot before it writes (core/engine/slot_state.py) and waits for the device. A prefix copy
(``copy_prefix``) copies a slot's first rows into another slot and the source's checkpoint (or
live state) into the target's state, device to device on the current stream, queued before the
step's forward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from mgserve.core.engine import slot_state
from mgserve.core.engine.checkpoints import CheckpointStore
from mgserve.core.engine.contract import PrefixCopy, SlotLoad, SlotSave, SlotTensors
from mgserve.core.engine.slot_state import Part, check, ckpt_name, copy_in, layout, rows
from mgserve.cuda.models.base import DeviceLM
from mgserve.cuda.pools import SlotPools
from mgserve.cuda.save_stream import SaveStream


class DeviceCheckpoint(NamedTuple):
    state: torch.Tensor  # [n] float32: the slot's recurrent tensors, packed (device or host)
    host: Any  # the model's host-side state of the slot (DeviceLM.host_state)


def save(model: DeviceLM, slot: int) -> DeviceCheckpoint:
    views = model.pools.recurrent(slot)
    return DeviceCheckpoint(torch.cat([v.reshape(-1) for v in views]), model.host_state(slot))


def load(model: DeviceLM, slot: int, ckpt: DeviceCheckpoint) -> None:
    views = model.pools.recurrent(slot)
    state = ckpt.state.to(views[0].device, non_blocking=True)  # from pinned memory: queued
    for v, part in zip(views, state.split([v.numel() for v in views]), strict=True):
        v.copy_(part.view_as(v))
    model.set_host_state(slot, ckpt.host)


def to_host(ckpt: DeviceCheckpoint) -> DeviceCheckpoint:
    if ckpt.state.device.type == "cpu":
        return ckpt  # a model on the CPU (tests): its device memory is host memory
    host = torch.empty(ckpt.state.shape, dtype=ckpt.state.dtype, pin_memory=True)
    host.copy_(ckpt.state, non_blocking=True)
    return DeviceCheckpoint(host, ckpt.host)


def _parts(pools: SlotPools, slot: int) -> dict[str, Part]:
    """The slot's positional tensors: K/V (q8_0 scales too) and QSA block keys, by layer."""
    parts: dict[str, Part] = {}
    for side, layers in (("k", pools.k), ("v", pools.v)):
        for il, kv in layers.items():
            parts[f"{side}.{il}"] = Part(kv.values[slot])
            if kv.quantized:
                parts[f"{side}.{il}.scales"] = Part(kv.scales[slot])
    for il, b in pools.blocks.items():
        parts[f"blocks.{il}"] = Part(b[slot], pools.pending[il].shape[1])
    return parts


def copy_prefix(model: DeviceLM, store: CheckpointStore[DeviceCheckpoint], op: PrefixCopy) -> None:
    pools = model.pools
    slot_state.copy_rows(_parts(pools, op.src), _parts(pools, op.dst), op.n)
    if pools.recurrent(op.dst):
        load(model, op.dst, save(model, op.src) if op.live else store.get(op.src, op.n))


def _named(prefix: str, ckpt: DeviceCheckpoint) -> dict[str, torch.Tensor]:
    out = {prefix + "state": ckpt.state}
    if ckpt.host is not None:
        out[prefix + "host"] = torch.from_numpy(np.array(ckpt.host, dtype=np.int64))
    return out


def save_slot(
    model: DeviceLM, store: CheckpointStore[DeviceCheckpoint], op: SlotSave, saves: SaveStream
) -> SlotTensors:
    n = len(op.tokens)
    out = {name: rows(p, n) for name, p in _parts(model.pools, op.slot).items()}
    if model.pools.recurrent(op.slot):
        out |= _named("", save(model, op.slot))
        for pos, ckpt in store.of_slot(op.slot, op.checkpoints).items():
            out |= _named(ckpt_name(pos, ""), ckpt)
    return saves.copy(op.slot, out)


def check_slot(model: DeviceLM, op: SlotLoad, host: Any) -> SlotTensors:
    """ValueError naming the first of ``op``'s tensors that does not fit its slot (nothing is
    written); else the tensors ``load_slot`` writes. ``host``: as ``load_slot``'s."""
    pools, n = model.pools, len(op.tokens)
    want = layout(_parts(pools, op.slot), n)
    views = pools.recurrent(op.slot)
    if views:
        for prefix in ["", *(ckpt_name(p, "") for p in op.checkpoints)]:
            want[prefix + "state"] = (views[0].dtype, (sum(v.numel() for v in views),))
            if host is not None:
                want[prefix + "host"] = (torch.int64, tuple(host.shape))
    given = {k: t for k, t in op.tensors.items() if not k.startswith("ckpt.") or k in want}
    check(given, want)
    return given


def load_slot(
    model: DeviceLM, store: CheckpointStore[DeviceCheckpoint], op: SlotLoad, host: Any
) -> None:
    """``host``: the model's host-side state of a fresh sequence (``DeviceLM.host_state``), whose
    shape a saved one must have."""
    given = check_slot(model, op, host)
    copy_in(_parts(model.pools, op.slot), len(op.tokens), given)
    views = model.pools.recurrent(op.slot)
    if views:
        device = views[0].device

        def ckpt(prefix: str) -> DeviceCheckpoint:
            host = given.get(prefix + "host")
            state = given[prefix + "state"].to(device, copy=True)
            return DeviceCheckpoint(state, None if host is None else host.numpy().copy())

        load(model, op.slot, ckpt(""))
        store.replace(op.slot, {p: ckpt(ckpt_name(p, "")) for p in op.checkpoints})
