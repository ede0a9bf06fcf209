"""Recurrent-state checkpoints of a device slot (core/engine/checkpoints.py says what they are
for and who decides which exist).

A checkpoint packs what a slot holds that is not positional (``SlotPools.recurrent``: DeltaNet
conv and recurrent states, QSA pending keys, the PLE conv history) into one flat float32 tensor,
with the model's host-side state of the slot beside it (qwen4exp: the PLE token history). Every
copy is queued on the current stream, none waits for the device: a checkpoint is taken after a
prompt step's forward, a move to host memory is one copy into pinned memory, and a restore (one
copy back from there, then a scatter into the pools) runs before the step that continues from it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mgserve.cuda.models.base import DeviceLM


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
