"""``LocalTransport``'s link throttle (virtual stages emulating another machine's links)."""

from __future__ import annotations

import pytest
import torch


def test_a_throttled_link_takes_its_bytes_at_its_rate() -> None:
    """``LinkThrottle`` (virtual stages emulating slower links): on the CPU a hand-off of n bytes
    over a link of r GB/s takes at least n / r seconds, the tensor unchanged; rates are one for
    all links or one per link."""
    import time

    from mgserve.pipeline.transport import LocalTransport

    cpu = torch.device("cpu")
    t = LocalTransport(3, cpu, link_gbps=[0.4, 0.1])  # 2 links
    x = torch.arange(2_500_000, dtype=torch.float32).view(-1, 4)  # 10 MB
    for link, want in ((0, 0.025), (1, 0.1)):
        t.begin()
        t.send(link, x)
        t0 = time.perf_counter()
        y = t.recv(link + 1, tuple(x.shape), cpu)
        assert time.perf_counter() - t0 >= want and torch.equal(y, x)
    assert LocalTransport(4, cpu, link_gbps=[2.0]).throttle.rates == [2e9] * 3
    for bad in ([1.0, 2.0], [0.0]):
        with pytest.raises(ValueError, match="link rates"):
            LocalTransport(4, cpu, link_gbps=bad)
