"""Streams and events: awaiting GPU work leaves the asyncio loop free; torch and cuda.core streams
interoperate in order."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_awaiting_an_event_keeps_the_loop_running(spin, stream) -> None:
    from mgserve.cuda import runtime

    spin_s = 0.2

    async def main() -> tuple[int, float]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        spin(stream, int(spin_s * 1e9))
        await runtime.wait_stream(stream)
        elapsed = time.perf_counter() - t0
        done.set()
        await task
        return ticks, elapsed

    ticks, elapsed = asyncio.run(main())
    print(f"event await: {elapsed * 1e3:.0f} ms of GPU spin, {ticks} loop ticks meanwhile")
    assert elapsed >= spin_s * 0.9, "the wait returned before the GPU finished"
    # a blocking wait would allow ~1 tick; a free loop ticks every ~1 ms (sleep granularity aside)
    assert ticks >= 50


def test_event_is_not_done_while_the_gpu_works(spin, stream) -> None:
    from mgserve.cuda import runtime

    spin(stream, 50_000_000)
    event = stream.record()
    assert not event.is_done
    asyncio.run(runtime.wait_event(event))
    assert event.is_done


def test_torch_and_cuda_core_streams_share_order(ops, stream) -> None:
    import numpy as np

    from mgserve.cuda import runtime
    from mgserve.cuda.weights import upload_bytes

    ts = runtime.torch_stream(stream)
    rng = np.random.default_rng(3)
    w_host = rng.standard_normal((64, 256), dtype=np.float32)  # [rows, k]
    w = upload_bytes("w", "F32", (256, 64), w_host)
    with torch.cuda.stream(ts):
        x = torch.ones(256, device="cuda")
        torch.cuda._sleep(50_000_000)  # queue torch work ahead: the kernel must wait for it
        x.mul_(2.0)
        y = ops.matvec(w, x, stream)
        z = y * 1.0  # torch reads the kernel's output, in stream order
    stream.sync()
    expected = torch.from_numpy(w_host).double().sum(1) * 2.0
    assert torch.allclose(z.cpu().double(), expected, rtol=1e-5, atol=1e-4)
