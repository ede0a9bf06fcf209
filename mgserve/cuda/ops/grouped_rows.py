"""The sorted (token, slot) pairs of one MoE layer by expert, as the grouped prompt GEMMs
(kernels/qgemm.cu, qgemm_wgmma.cu) read them, and the bound on their tiles that sizes a grid
without reading the counts back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mgserve.cuda.launch import MAX_GRID_Y


def grouped_tiles(n_pairs: int, n_expert: int, bm: int) -> int:
    """An upper bound of sum_e ceil(count_e / bm) over any counts summing to n_pairs: every
    expert's last tile may be partial, the others are full."""
    return n_pairs // bm + min(n_expert, n_pairs)


class GroupedRows:
    """The sorted (token, slot) pairs of one MoE layer, by expert, as the grouped kernels read
    them: int32 [E + 1] row_start (first sorted position of each expert) and tile_start (first
    tile of each expert, tiles of ``bm`` rows), all made on the device."""

    def __init__(self, sorted_e: torch.Tensor, n_expert: int, bm: int) -> None:
        dev = sorted_e.device
        ids = torch.arange(n_expert + 1, dtype=sorted_e.dtype, device=dev)  # [E + 1]
        self.row_start = torch.searchsorted(sorted_e, ids, out_int32=True)  # [E + 1]
        tiles = (self.row_start[1:] - self.row_start[:-1] + (bm - 1)) // bm  # [E]
        self.tile_start = F.pad(torch.cumsum(tiles, 0, dtype=torch.int32), (1, 0))  # [E + 1]
        self.n_pairs, self.n_expert, self.bm = sorted_e.numel(), n_expert, bm

    @property
    def grid_y(self) -> int:
        """CTAs along y: the worst case over all routings (the counts stay on the device)."""
        y = grouped_tiles(self.n_pairs, self.n_expert, self.bm)
        if y > MAX_GRID_Y:
            raise ValueError(f"grouped GEMM: {self.n_pairs} pairs exceed the grid ({y} tiles)")
        return y
