"""``DenseWeights``: the float32 form of ``QuantWeight`` matrices, made once and kept, for the
torch op families (which multiply dense matrices where the kernels read GGUF blocks)."""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.weights import QuantWeight


def dequantize_weight(w: QuantWeight) -> torch.Tensor:
    """float32 [rows, k] of a QuantWeight, on the weight's device (through gguf-py on the host:
    slow, for the torch backend and tests only)."""
    from gguf import GGMLQuantizationType, quants

    raw = w.data.cpu().numpy().reshape(-1)
    if w.type_name == "F32":
        values = raw.view(np.float32)
    elif w.type_name == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif w.type_name == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        values = quants.dequantize(raw, GGMLQuantizationType[w.type_name])
    dense = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(w.rows, w.k)
    return dense.to(w.data.device)


class DenseWeights:
    """Dequantized weights keyed by the weight's storage; one cache serves every torch family of
    a backend, so a matrix read by two families is dequantized once."""

    def __init__(self) -> None:
        self._dense: dict[int, torch.Tensor] = {}

    def __call__(self, w: QuantWeight) -> torch.Tensor:
        """float32 [rows, k] of ``w`` (cached)."""
        key = w.data.data_ptr()
        d = self._dense.get(key)
        if d is None or d.shape != (w.rows, w.k):
            d = self._dense[key] = dequantize_weight(w)
        return d
