"""Slot saves copied to host memory beside the steps, on a GPU stream of their own.

A slot save (``snapshots.save_slot``) gives the tensors to copy: a slot's K/V rows and QSA block
keys, its packed live state and checkpoints. On a GPU the device -> pinned host copies are queued
on the save stream behind everything the compute stream queued so far, and the step returns at
once: decoders keep going while the copies run. What the save returns is a mapping that waits for
them when a tensor is read (the slot file is written in a worker thread, off the event loop). A
later step that writes into a slot still being saved waits for that save on the device first
(``before``: the compute stream waits for its event, no host wait), and the caching allocator
keeps whatever a copy reads (a packed state, a checkpoint dropped meanwhile) until it is done.
Host tensors (checkpoints in host memory, the PLE token history) are never written again once
made, so the mapping holds them as they are. On the CPU every copy is plain.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from mgserve.core.engine.contract import SlotTensors


class _Copying(Mapping[str, torch.Tensor]):
    """Host tensors the save stream is filling: reading one waits for the copies."""

    def __init__(self, tensors: dict[str, torch.Tensor], done: torch.cuda.Event) -> None:
        self._tensors, self._done = tensors, done

    def __getitem__(self, name: str) -> torch.Tensor:
        self._done.synchronize()
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class SaveStream:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._saving: dict[int, torch.cuda.Event] = {}  # slot -> the end of its save's copies

    def copy(self, slot: int, tensors: Mapping[str, torch.Tensor]) -> SlotTensors:
        """``slot``'s ``tensors`` (device or host) in host memory, copied behind the queued
        work."""
        side = self._stream
        if side is None:
            return {name: t.to("cpu", copy=True) for name, t in tensors.items()}
        side.wait_stream(torch.cuda.current_stream(self._device))
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(side):
            for name, t in tensors.items():
                if t.device.type == "cpu":
                    out[name] = t
                    continue
                out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out[name].copy_(t, non_blocking=True)
                t.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        self._saving[slot] = done
        return _Copying(out, done)

    def before(self, slots: Iterable[int]) -> None:
        """A step is about to write into ``slots``: the compute stream waits for their saves."""
        for slot in slots:
            done = self._saving.pop(slot, None)
            if done is not None:
                torch.cuda.current_stream(self._device).wait_event(done)
