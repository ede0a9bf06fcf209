"""One GPU as mgserve sees it: a cuda.core Device made current, its streams and events, and a way
to await GPU work on the asyncio loop without blocking it.

This is the only module of the running server that imports ``cuda.bindings`` (STYLE.md 6): the
NVRTC version for the cubin cache key and a kernel's dynamic shared memory limit are what cuda.core
does not expose. (offline.py, ``mgserve kernels check``, calls NVRTC through it too: no device.)

Torch allocates memory and cuda.core launches kernels, so the two must agree on streams: a
``Stream`` here can be handed to torch (``torch_stream``) and a torch stream to cuda.core
(``stream_from_torch``); pointers cross freely.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from cuda.core import Device, Event, Kernel, Stream

# How often an awaited event is polled. The loop stays free between polls; 50 us adds at most that
# much latency to a ~10-30 ms decode step.
POLL_S = 50e-6


@cache
def nvrtc_version() -> tuple[int, int]:
    """The NVRTC (major, minor) that compiles our kernels; part of the cubin cache key."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def cuda_core_version() -> tuple[int, ...]:
    """cuda.core's (major, minor, ...); (0,) where it does not say."""
    import cuda.core

    text = getattr(cuda.core, "__version__", "0")
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit()) or (0,)


def allow_smem(kernel: Kernel, nbytes: int, device_index: int) -> None:
    """Let ``kernel`` use ``nbytes`` of dynamic shared memory (above the 48 KB default)."""
    from cuda.bindings import driver

    handle = kernel.handle  # a CUkernel (cuda.core loads cubins as libraries)
    if not isinstance(handle, driver.CUkernel):
        handle = driver.CUkernel(int(handle))
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, driver.CUdevice(device_index))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(max dynamic smem {nbytes}) failed: {err}")


@cache
def device(index: int = 0) -> Device:
    """The cuda.core Device ``index``, current on this thread (torch's primary context too)."""
    from cuda.core import Device

    dev = Device(index)
    dev.set_current()
    return dev


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    arch: str  # "90" for sm_90, as NVRTC's arch option wants it after "sm_"
    multiprocessors: int


def gpu_info(index: int = 0) -> GpuInfo:
    dev = device(index)
    return GpuInfo(
        index=index,
        name=dev.name,
        arch=dev.arch,
        multiprocessors=dev.properties.multiprocessor_count,
    )


def new_stream(index: int = 0, priority: int | None = None) -> Stream:
    """A non-blocking stream on GPU ``index`` (never waits for the legacy default stream) of its
    own: not one of torch's pooled streams, which torch hands out again to other code;
    ``priority`` a CUDA stream priority (lower runs first), None the lowest."""
    if priority is None:
        return device(index).create_stream()
    return device(index).create_stream(options={"nonblocking": True, "priority": priority})


def new_event(index: int = 0, timing: bool = False) -> Event:
    return device(index).create_event({"timing_enabled": timing})


class _TorchStreamHandle:
    """Presents a torch stream through the ``__cuda_stream__`` protocol that cuda.core accepts."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def stream_from_torch(ts: torch.cuda.Stream, index: int = 0) -> Stream:
    """cuda.core's view of a torch stream (same CUstream): kernels land in torch's order."""
    return device(index).create_stream(_TorchStreamHandle(ts.cuda_stream))


def torch_stream(stream: Stream, index: int = 0) -> torch.cuda.ExternalStream:
    """Torch's view of a cuda.core stream, for ``with torch.cuda.stream(...)`` around torch ops."""
    import torch

    return torch.cuda.ExternalStream(int(stream.handle), device=torch.device("cuda", index))


async def wait_event(event: Event, poll_s: float = POLL_S) -> None:
    """Wait for ``event`` on the asyncio loop, letting other tasks run meanwhile.

    ``Event.sync()`` would block the loop for the whole GPU step; polling ``is_done`` costs a few
    microseconds per poll and no thread.
    """
    while not event.is_done:
        await asyncio.sleep(poll_s)


async def wait_stream(stream: Stream, poll_s: float = POLL_S) -> None:
    """Record an event at the stream's current end and wait for it without blocking the loop."""
    await wait_event(stream.record(), poll_s)
