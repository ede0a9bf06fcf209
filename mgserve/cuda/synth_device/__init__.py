"""Synthetic full-width models made in memory, for benchmarks: no GGUF file is written or read.

``mgserve synth`` writes a random-weight GGUF (``mgserve.core.synth.write``); at full width that is
~35 GB for a 48-layer, 256-expert qwen4exp, and pushing it through the device machine's disk twice
costs minutes of scarce device time. ``SynthFile`` is the same model without the file:

- it quacks like ``GGUFFile`` (it is one, for ``isinstance``): ``metadata`` holds exactly the
  values ``GGUFFile`` would decode from the file ``write_synth`` writes for the same ``ShapeSpec``,
  ``tensors`` the same names, types and shapes;
- small tensors (at most ``HOST_MAX_ELEMENTS`` values: norm gammas, conv taps, DeltaNet gates,
  routers of few experts, ...) carry host numpy data in ``GGUFFile``'s layout, with values chosen
  per kind so a forward pass stays finite and sane (gammas near 1, ``ssm_a`` negative, ...);
- big ones (every large matrix) have ``data = None``: ``Loader.mat`` then calls ``synth_weight``,
  which makes the tensor's blocks directly on the device by tiling a per-type random pool;
- the PLE table (``per_layer_token_embd``) stays on the host as ``GGUFFile`` keeps it, tiled from
  a small pool.

Nothing here is meant to produce meaningful text. The modules:

    blocks.py   valid random blocks of each quant type at a realistic scale (WEIGHT_STD)
    values.py   the per-kind values of small tensors that random weights would break
    ple.py      the PLE table: a tiled pool, materialised or memfd-mapped
    device.py   synth_weight: a large matrix made on the device from a cached per-type pool
    file.py     SynthFile: the metadata, the tensor table and the host data
"""

from __future__ import annotations

from mgserve.cuda.synth_device.blocks import supported_types
from mgserve.cuda.synth_device.device import release_pools, synth_weight
from mgserve.cuda.synth_device.file import SynthFile

__all__ = ["SynthFile", "release_pools", "supported_types", "synth_weight"]
