"""Argument checks of the device backend's ops, stated once: each raises ValueError with a message
naming the argument. The torch families check shapes and dtypes; the CUDA families add device,
contiguity and alignment, which the kernels need."""

from __future__ import annotations

import torch

from mgserve.cuda.weights import FORMATS, QuantWeight


def shape_error(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {list(t.shape)}, expected {expected}")


def check_f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, n: int) -> None:
    """``t`` is a [n] int32 or int64 tensor (slots, positions, lengths)."""
    if t.dim() != 1 or t.shape[0] != n:
        raise shape_error(name, t, f"[{n}]")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def check_cuda(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError unless ``t`` is a contiguous ``dtype`` tensor on ``device``."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_vec4(name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """``check_cuda``, and 16-byte aligned: the kernel reads ``t`` as float4."""
    check_cuda(name, t, device, dtype)
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (the kernel reads float4)")


def check_weight(w: QuantWeight, device: torch.device) -> None:
    """ValueError unless ``w`` is whole, contiguous, 16-byte aligned uint8 blocks on ``device``
    of a type the kernels read."""
    fmt = FORMATS.get(w.type_name)
    if fmt is None:
        raise ValueError(f"{w.name}: no CUDA kernel for type {w.type_name}")
    if w.data.device != device or w.data.dtype != torch.uint8:
        raise ValueError(f"{w.name}: weight bytes must be uint8 on {device}")
    if (
        not w.data.is_contiguous()
        or w.data.numel() != w.rows * (w.k // fmt.block) * fmt.nbytes
        or w.data.data_ptr() % 16
    ):
        raise ValueError(f"{w.name}: weight bytes must be contiguous, 16-byte aligned, whole")


def on_device(device: torch.device, *ts: torch.Tensor) -> bool:
    return all(t.device == device for t in ts)


def as_i32(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index tensor as the kernels read it: int32 and contiguous (converted on the device)."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def rows_view(x: torch.Tensor, d: int) -> tuple[torch.Tensor, int, int]:
    """x seen as [rows, d] with unit stride along d: (tensor, rows, row stride in elements), for
    the row-wise kernels (norms, activations). A contiguous tensor or a view with evenly spaced
    rows (a column slice of a wider activation, e.g. the gate halves [N, H, D] of [N, H, 2 D]) is
    read in place; anything else is copied to a contiguous tensor first."""
    if x.is_contiguous():
        return x, (x.numel() // d if d else 0), d
    if x.dim() >= 2 and x.shape[-1] == d and x.stride(-1) == 1:
        try:
            rows = x.view(-1, d)  # a view exactly when the leading dims collapse to one stride
        except RuntimeError:
            pass
        else:
            return rows, rows.shape[0], rows.stride(0)
    x = x.contiguous()
    return x, (x.numel() // d if d else 0), d


def vec4_ok(*pairs: tuple[torch.Tensor, int]) -> bool:
    """Whether every tensor is 16-byte aligned and every given stride a multiple of 4 floats."""
    return all(t.data_ptr() % 16 == 0 and s % 4 == 0 for t, s in pairs)


def vec4_input(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as the float4 kernels read an activation: contiguous and 16-byte aligned (a copy only
    when it is not: model code passes views), float32 on ``device`` (else ValueError)."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    check_vec4(name, t, device, torch.float32)
    return t


def tuning_ints(text: str, what: str, fields: str) -> list[int]:
    """A kernel tuning's bench flag ``text`` as ints, one per field of ``fields`` (its spelling,
    optional ones in brackets: "BM,BN[,MIN_CTAS]"); ValueError naming ``what`` unless ``text``
    is that many comma-separated ints, the required ones at least."""
    names = fields.replace("[", "").replace("]", "").split(",")
    required = fields.split("[")[0].rstrip(",").count(",") + 1
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not required <= len(values) <= len(names):
        raise ValueError(f"{what} tuning {text!r}: expected {fields}")
    return values
