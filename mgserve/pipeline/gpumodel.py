"""Stage times on a GPU we do not have, from a stated model of it: each layer of a step takes the
longer of its bytes at the GPU's effective memory bandwidth and its FLOPs at its effective tensor
throughput (a roofline), plus a fixed overhead per layer (kernel launches and tails); and PCIe
links between GPUs from their lane counts. Every figure is a field with a default, printed by
``mgserve bench pipeline-model``; the layers' bytes and FLOPs come from costs.py.

A hop between consecutive GPUs without peer access is two copies through pinned host memory,
one after the other (device to host on the sender's link, host to device on the receiver's):
their times add, so the hop is one link of ``1 / (1/bw_a + 1/bw_b)`` bytes/s and twice the
latency. With peer access it is one copy at the narrower link's rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mgserve.cuda.plan_sizes import Part
from mgserve.pipeline.costs import ModelCosts
from mgserve.pipeline.perfmodel import Link

PCIE_LANE_GBPS = {3: 0.985, 4: 1.969, 5: 3.938}  # raw GB/s per lane and direction (128b/130b)


@dataclass(frozen=True)
class GpuModel:
    name: str = "RTX 3090"
    bandwidth_gbps: float = 936.0  # memory bandwidth, GB/s
    bandwidth_eff: float = 0.75  # share of it a decode step's reads reach
    tflops: float = 71.0  # dense fp16 tensor-core peak (fp16 accumulate; 35.6 with fp32)
    flops_eff: float = 0.5  # share of it a prompt chunk's matrix products reach
    layer_overhead_us: float = 40.0  # per layer and step: launches, tails, small kernels

    def roofline(self, nbytes: float, flops: float) -> float:
        return max(
            nbytes / (self.bandwidth_gbps * 1e9 * self.bandwidth_eff),
            flops / (self.tflops * 1e12 * self.flops_eff),
        )

    def decode_step(self, costs: ModelCosts, part: Part, sessions: int, depth: int) -> float:
        """Seconds of one decode step of ``sessions`` sessions at ``depth`` on ``part``."""
        t = 0.0
        for il in range(part.start, part.stop):
            nbytes = costs.weight_read(il, sessions) + sessions * costs.session_bytes(il, depth)
            flops = sessions * (costs.token_flops(il) + costs.session_flops(il, depth))
            t += self.roofline(nbytes, flops) + self.layer_overhead_us * 1e-6
        if part.last:
            t += self.roofline(costs.head_bytes, sessions * costs.head_flops)
        return t

    def prefill_chunk(self, costs: ModelCosts, part: Part, tokens: int, depth: int) -> float:
        """Seconds of a prompt chunk of ``tokens`` tokens starting at ``depth`` on ``part``: its
        weights once (the experts its tokens hit), the DeltaNet state once, K/V written, the
        attention at the chunk's middle depth; the head only for the last token (left out)."""
        t, mid = 0.0, depth + tokens // 2
        for il in range(part.start, part.stop):
            kind = costs.layers[il].kind
            nbytes = costs.weight_read(il, tokens)
            nbytes += 2 * costs.state_bytes if kind == "recurrent" else tokens * costs.kv_cell
            flops = tokens * (costs.token_flops(il) + costs.session_flops(il, mid))
            t += self.roofline(nbytes, flops) + self.layer_overhead_us * 1e-6
        return t


@dataclass(frozen=True)
class PcieModel:
    gen: int = 4
    lane_eff: float = 0.8  # share of the raw lane rate a large cudaMemcpyAsync reaches
    latency_us: float = 10.0  # per copy: the call, the DMA start, the event the next waits on
    p2p: bool = False  # peer copies (consumer cards without NVLink usually cannot)

    def lane_rate(self) -> float:
        """Effective bytes/s per lane and direction."""
        if self.gen not in PCIE_LANE_GBPS:
            raise ValueError(f"PCIe gen must be one of {sorted(PCIE_LANE_GBPS)}, got {self.gen}")
        return PCIE_LANE_GBPS[self.gen] * 1e9 * self.lane_eff

    def host_link(self, lanes: int) -> Link:
        """One copy between the host and a GPU on ``lanes`` lanes."""
        return Link(lanes * self.lane_rate(), self.latency_us * 1e-6)

    def hop(self, lanes_a: int, lanes_b: int) -> Link:
        """GPU a to GPU b: a peer copy, or two staged copies through the host."""
        a, b = self.host_link(lanes_a), self.host_link(lanes_b)
        if self.p2p:
            return Link(min(a.bandwidth, b.bandwidth), a.latency)
        return Link(1.0 / (1.0 / a.bandwidth + 1.0 / b.bandwidth), a.latency + b.latency)

    def hops(self, lanes: Sequence[int]) -> list[Link]:
        return [self.hop(a, b) for a, b in zip(lanes, lanes[1:], strict=False)]
