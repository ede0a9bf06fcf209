"""A Gemma 3 270M-shaped GGUF with random valid blocks, for timing kernels on the device without
carrying the real 253 MB file: the real file's header (metadata, tokenizer and tensor table: the
first 6.5 MB, ``head -c <first tensor offset>``) followed by random quants whose block scales are
small finite f16 values, in the header's tensor order and offsets. The text it writes is noise;
kernel times and launch counts are the real model's.

    python3 tests/cuda/gemma_shaped.py HEADER OUT
"""

from __future__ import annotations

import sys

import numpy as np

from mgserve.core.gguf.reader import GGUFFile

# block bytes and the byte offsets of each block's f16 scales, per type
_BLOCKS = {"Q8_0": (34, (0,)), "Q5_0": (22, (0,)), "Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}
_SCALE = np.array([0.01], dtype=np.float16).view(np.uint8)


def main(header: str, out: str) -> None:
    with open(header, "rb") as f:
        head = f.read()
    with open(out, "wb") as f:  # the header, then a sparse tail the reader accepts
        f.write(head)
        f.truncate(len(head) + (1 << 30))
    tensors = sorted(GGUFFile(out).tensors.values(), key=lambda t: t.offset)
    rng = np.random.default_rng(0)
    with open(out, "r+b") as f:
        f.truncate(tensors[-1].offset + tensors[-1].n_bytes)
        for t in tensors:
            f.seek(t.offset)
            if t.type_name == "F32":
                f.write(rng.normal(0.0, 0.1, t.n_elements).astype(np.float32).tobytes())
                continue
            size, scales = _BLOCKS[t.type_name]
            blocks = rng.integers(0, 256, (t.n_bytes // size, size), dtype=np.uint8)
            for s in scales:
                blocks[:, s : s + 2] = _SCALE
            f.write(blocks.tobytes())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
