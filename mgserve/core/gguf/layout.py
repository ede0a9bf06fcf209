"""Which GGUF tensor shapes a loader accepts: llama.cpp's rule, in one place.

llama.cpp's ``create_tensor`` (src/llama-model-loader.cpp ``check_tensor_dims``) takes a tensor
whose shape equals the expected one in GGUF order (ne0 first) up to trailing dims of 1 (a converter
may write the shared-expert gate as [n_embd, 1] where the loader asks for [n_embd]). Tensors
created with ``TENSOR_ALLOW_RESHAPE`` only need as many elements, in any shape: qwen4exp's
hyper-connection and PLE norm gammas are asked for as [n_embd, hc] and the converter writes the
checkpoint's own 1-D [n_embd * hc]; the element order is the same either way (stream-major), so the
data reads into the expected shape unchanged.

Both the reference loaders (core/models) and the device loader (cuda/loader.py) check shapes here,
so a file one of them takes the other takes too, and both refuse a wrong one with the same message.
"""

from __future__ import annotations

from math import prod

from mgserve.core.gguf.reader import GGUFError, GGUFFile, TensorInfo


def strip_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without trailing dims of 1 (at least one dim stays)."""
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def shape_accepted(actual: tuple[int, ...], expected: tuple[int, ...], reshape_ok: bool) -> bool:
    """llama.cpp's check: equal up to trailing 1s, or (``reshape_ok``) equally many elements."""
    if reshape_ok:
        return prod(actual) == prod(expected)
    return strip_ones(actual) == strip_ones(expected)


def torch_shape(expected: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape ([..., ne1, ne0]) a tensor accepted for GGUF shape ``expected`` reads as."""
    return tuple(reversed(strip_ones(expected)))


def check_tensor(
    g: GGUFFile, name: str, expected: tuple[int, ...], reshape_ok: bool = False
) -> TensorInfo:
    """The tensor ``name`` after checking its shape against ``expected`` (GGUF order);
    GGUFError naming the file and the tensor if it is missing or its shape is wrong."""
    t = g.tensor(name)
    if not shape_accepted(t.shape, expected, reshape_ok):
        also = f" or any shape of {prod(expected)} elements" if reshape_ok else ""
        raise GGUFError(
            f"{g.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(expected)}{also}"
        )
    return t
